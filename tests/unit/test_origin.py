"""The origin signature (p2p/origin.py): a message handed on by anyone still proves its author,
and any change to what it says, or to where it claims to belong, breaks it."""

import dataclasses

import numpy as np
import pytest

from p2p.identity import NodeIdentity
from p2p.messages import OutgoingMessage
from p2p.origin import ORIGIN, ORIGIN_DIGEST, origin_holds, origin_signed, sign_origin
from tests.p2p_helpers import MANIFEST, SWARM, as_received


def signed(author: NodeIdentity, round_index: int = 7) -> OutgoingMessage:
    message = OutgoingMessage.from_arrays("dilocox.pgrad", round_index,
                                          {"a": np.arange(10, dtype=np.uint8),
                                           "b": np.ones(3, dtype=np.float32)})
    sign_origin(author, SWARM, MANIFEST, message)
    return message


def test_a_copy_delivered_by_a_relay_proves_its_author():
    author, relay = NodeIdentity.generate(), NodeIdentity.generate()
    copy = as_received(signed(author), delivered_by=relay)
    assert origin_holds(author.peer_id, SWARM, MANIFEST, "dilocox.pgrad", copy)
    assert origin_holds(author.peer_id.to_base58(), SWARM, MANIFEST, "dilocox.pgrad", copy)
    assert not origin_holds(relay.peer_id, SWARM, MANIFEST, "dilocox.pgrad", copy)


@pytest.mark.parametrize("change", ["payload", "shape", "round", "swarm", "manifest", "kind",
                                    "signature", "digest", "no signature", "not an id"])
def test_any_change_breaks_the_origin_signature(change):
    author = NodeIdentity.generate()
    copy = as_received(signed(author), delivered_by=NodeIdentity.generate())
    swarm, manifest, kind, who = SWARM, MANIFEST, "dilocox.pgrad", author.peer_id
    if change == "payload":
        altered = bytearray(copy.payload)
        altered[3] ^= 1
        copy = dataclasses.replace(copy, payload=memoryview(bytes(altered)))
    elif change == "shape":
        first = copy.tensors[0]
        copy = dataclasses.replace(copy, tensors=(dataclasses.replace(first, shape=(2, 5)),
                                                  *copy.tensors[1:]))
    elif change == "round":
        copy = dataclasses.replace(copy, header=dataclasses.replace(copy.header, round=8))
    elif change == "signature":
        forged = bytes(64)
        copy = dataclasses.replace(copy, header=dataclasses.replace(
            copy.header, meta={**copy.header.meta, ORIGIN: forged}))
    elif change == "digest":  # a signature over another content than the one it came with
        copy = dataclasses.replace(copy, header=dataclasses.replace(
            copy.header, meta={**copy.header.meta, ORIGIN_DIGEST: bytes(32)}))
    elif change == "no signature":
        copy = dataclasses.replace(copy, header=dataclasses.replace(copy.header, meta={}))
    elif change == "not an id":
        who = "not-a-peer-id"
    else:
        swarm, manifest, kind = {"swarm": ("other", MANIFEST, kind), "manifest": (SWARM, "f" * 32, kind),
                                 "kind": (SWARM, MANIFEST, "noloco.snapshot")}[change]
    assert not origin_holds(who, swarm, manifest, kind, copy)


def test_the_signed_digest_proves_the_content_from_the_header_alone():
    """What a frame's header carries (the content digest and the signature over it) checks
    without the payload, and binds the author, the round and the digest."""
    author, other = NodeIdentity.generate(), NodeIdentity.generate()
    meta = signed(author).meta
    digest, signature = meta[ORIGIN_DIGEST], meta[ORIGIN]
    assert origin_signed(author.peer_id, SWARM, MANIFEST, "dilocox.pgrad", 7, digest, signature)
    assert not origin_signed(other.peer_id, SWARM, MANIFEST, "dilocox.pgrad", 7, digest, signature)
    assert not origin_signed(author.peer_id, SWARM, MANIFEST, "dilocox.pgrad", 8, digest, signature)
    assert not origin_signed(author.peer_id, SWARM, MANIFEST, "dilocox.pgrad", 7, bytes(32), signature)
    assert not origin_signed(author.peer_id, SWARM, MANIFEST, "dilocox.pgrad", 7, "text", signature)
