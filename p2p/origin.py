"""A message's origin signature: its author's signature over what the message says and not over
whom it went to, so a member that received it can hand it on and every later receiver still
knows who wrote it and that nothing of it changed.

A frame's signature binds its recipient, nonce and clock (p2p/wire.py), so a received message
cannot be forwarded as it came. The origin signature covers a domain tag, the swarm, the
manifest digest, the kind, the round, the author's peer id and the BLAKE3 digest of the tensor
manifest and payload; it travels in the message's meta under `ORIGIN`. The author's public key
is its peer id (p2p/identity.py): no key record is needed to check it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgpack
from hivemind.p2p import PeerID

from p2p.errors import IdentityError
from p2p.identity import NodeIdentity, peer_id_bytes, verify_signature
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.wire import TensorEntry, new_payload_hasher

ORIGIN = "origin"
DOMAIN = b"lowcomm/origin/v1\x00"


def _signed_bytes(swarm: str, manifest: str, kind: str, round_index: int, author: bytes,
                  tensors: Sequence[TensorEntry], payload: Iterable[bytes | memoryview]) -> bytes:
    hasher = new_payload_hasher()
    hasher.update(msgpack.packb([t.to_wire() for t in tensors]))
    for chunk in payload:
        hasher.update(chunk)
    return DOMAIN + msgpack.packb([swarm, manifest, kind, round_index, author, hasher.digest()])


def sign_origin(identity: NodeIdentity, swarm: str, manifest: str, message: OutgoingMessage) -> bytes:
    """Our signature over `message` as any member may hand it on (hashes the whole payload)."""
    return identity.sign(_signed_bytes(swarm, manifest, message.kind, message.round,
                                       identity.peer_id.to_bytes(), message.manifest(),
                                       message.segments()))


def origin_holds(author: PeerID | str | bytes, swarm: str, manifest: str, kind: str,
                 message: ReceivedMessage) -> bool:
    """True when `message` (whoever delivered it) carries `author`'s origin signature over its
    kind and round in our swarm and manifest, its tensor manifest and its payload."""
    signature = message.meta.get(ORIGIN)
    if not isinstance(signature, bytes):
        return False
    try:
        raw = peer_id_bytes(author)
    except IdentityError:
        return False
    return verify_signature(raw, _signed_bytes(swarm, manifest, kind, message.round, raw,
                                               message.tensors, (message.payload,)), signature)
