"""The origin signature (p2p/origin.py): a message handed on by anyone still proves its author,
and any change to what it says, or to where it claims to belong, breaks it."""

import dataclasses

import numpy as np
import pytest

from p2p.identity import NodeIdentity
from p2p.messages import OutgoingMessage
from p2p.origin import ORIGIN, origin_holds, sign_origin
from tests.p2p_helpers import MANIFEST, SWARM, as_received


def signed(author: NodeIdentity, round_index: int = 7) -> OutgoingMessage:
    message = OutgoingMessage.from_arrays("dilocox.pgrad", round_index,
                                          {"a": np.arange(10, dtype=np.uint8),
                                           "b": np.ones(3, dtype=np.float32)})
    message.meta[ORIGIN] = sign_origin(author, SWARM, MANIFEST, message)
    return message


def test_a_copy_delivered_by_a_relay_proves_its_author():
    author, relay = NodeIdentity.generate(), NodeIdentity.generate()
    copy = as_received(signed(author), delivered_by=relay)
    assert origin_holds(author.peer_id, SWARM, MANIFEST, "dilocox.pgrad", copy)
    assert origin_holds(author.peer_id.to_base58(), SWARM, MANIFEST, "dilocox.pgrad", copy)
    assert not origin_holds(relay.peer_id, SWARM, MANIFEST, "dilocox.pgrad", copy)


@pytest.mark.parametrize("change", ["payload", "shape", "round", "swarm", "manifest", "kind",
                                    "signature", "no signature", "not an id"])
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
            copy.header, meta={ORIGIN: forged}))
    elif change == "no signature":
        copy = dataclasses.replace(copy, header=dataclasses.replace(copy.header, meta={}))
    elif change == "not an id":
        who = "not-a-peer-id"
    else:
        swarm, manifest, kind = {"swarm": ("other", MANIFEST, kind), "manifest": (SWARM, "f" * 32, kind),
                                 "kind": (SWARM, MANIFEST, "noloco.snapshot")}[change]
    assert not origin_holds(who, swarm, manifest, kind, copy)
