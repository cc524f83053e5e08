"""A message's origin signature: its author's signature over what the message says and not over
whom it went to, so a member that received it can hand it on and every later receiver still
knows who wrote it and that nothing of it changed.

A frame's signature binds its recipient, nonce and clock (p2p/wire.py), so a received message
cannot be forwarded as it came. The origin signature covers a domain tag, the swarm, the
manifest digest, the kind, the round, the author's peer id and the BLAKE3 digest of the tensor
manifest and payload (the content digest, which travels beside it under `ORIGIN_DIGEST`); it
travels in the message's meta under `ORIGIN`. The author's public key is its peer id
(p2p/identity.py): no key record is needed to check it.

Since the signature covers the content digest, the pair (digest, signature) in a frame's header
is the author's signed word on the content of its message of that round, checkable before the
payload is read (`origin_signed`): two such pairs with different digests for one round are
proof that the author signed two versions of it.
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
ORIGIN_DIGEST = "origin_digest"
DOMAIN = b"lowcomm/origin/v1\x00"
DIGEST_BYTES = 32


def content_digest(tensors: Sequence[TensorEntry], payload: Iterable[bytes | memoryview]) -> bytes:
    """The BLAKE3 digest of a message's tensor manifest and payload: what the signature binds."""
    hasher = new_payload_hasher()
    hasher.update(msgpack.packb([t.to_wire() for t in tensors]))
    for chunk in payload:
        hasher.update(chunk)
    return hasher.digest()


def _signed_bytes(swarm: str, manifest: str, kind: str, round_index: int, author: bytes,
                  digest: bytes) -> bytes:
    return DOMAIN + msgpack.packb([swarm, manifest, kind, round_index, author, digest])


def sign_origin(identity: NodeIdentity, swarm: str, manifest: str, message: OutgoingMessage) -> None:
    """Puts our origin signature over `message`, as any member may hand it on, and the content
    digest it covers in its meta (hashes the whole payload)."""
    digest = content_digest(message.manifest(), message.segments())
    message.meta[ORIGIN_DIGEST] = digest
    message.meta[ORIGIN] = identity.sign(_signed_bytes(swarm, manifest, message.kind, message.round,
                                                       identity.peer_id.to_bytes(), digest))


def origin_signed(author: PeerID | str | bytes, swarm: str, manifest: str, kind: str,
                  round_index: int, digest: object, signature: object) -> bool:
    """True when `signature` is `author`'s origin signature over content `digest` for its
    message of `kind` and `round_index` in our swarm and manifest (no payload needed)."""
    if not (isinstance(digest, bytes) and len(digest) == DIGEST_BYTES and isinstance(signature, bytes)):
        return False
    try:
        raw = peer_id_bytes(author)
    except IdentityError:
        return False
    return verify_signature(raw, _signed_bytes(swarm, manifest, kind, round_index, raw, digest),
                            signature)


def origin_holds(author: PeerID | str | bytes, swarm: str, manifest: str, kind: str,
                 message: ReceivedMessage) -> bool:
    """True when `message` (whoever delivered it) carries `author`'s origin signature over its
    kind and round in our swarm and manifest, and its tensor manifest and payload hash to the
    digest that signature covers: its meta's ORIGIN_DIGEST is then the author's word on it."""
    digest = message.meta.get(ORIGIN_DIGEST)
    return digest == content_digest(message.tensors, (message.payload,)) and origin_signed(
        author, swarm, manifest, kind, message.round, digest, message.meta.get(ORIGIN))
