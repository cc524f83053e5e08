"""Shared helpers for the p2p tests: hand-made frames, hosts on loopback, and a member process.

Run as a module, this file is the node that integration tests SIGKILL:

    python -m tests.p2p_helpers member DATA_DIR SWARM TTL INITIAL_PEER

It prints one JSON line (peer id, p2pd pid, p2pd's unix socket, and its own: the client socket
hivemind listens on for p2pd) once its membership record is stored, then serves until killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

from p2p.identity import NodeIdentity, identity_path
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.wire import (NONCE_BYTES, MessageHeader, Mode, TensorEntry, encode_header, frame_prefix,
                      payload_digest, signing_input)

T = TypeVar("T")
SWARM, MANIFEST = "test-swarm", "0123456789abcdef0123456789abcdef"


def make_header(author: NodeIdentity, to: bytes, payload: bytes = b"", **overrides: Any) -> MessageHeader:
    """A valid single-frame header from `author` to peer id bytes `to` for `payload` (one uint8
    tensor), with any field overridden."""
    fields = dict(swarm=SWARM, manifest=MANIFEST, kind="test", mode=Mode.PUSH, round=1,
                  sender=author.peer_id.to_bytes(), recipient=to, nonce=os.urandom(NONCE_BYTES),
                  reply_to=None, timestamp=time.time(), total=len(payload), frame=0, frames=1, streams=1,
                  frame_size=max(len(payload), 64 * 1024), length=len(payload), digest=payload_digest(payload),
                  tensors=(TensorEntry("t", "uint8", (len(payload),), len(payload)),), meta={})
    fields.update(overrides)
    return MessageHeader(**fields)


def as_received(message: OutgoingMessage, delivered_by: NodeIdentity) -> ReceivedMessage:
    """`message` as the transport hands it over, delivered by `delivered_by` (a relay, perhaps)."""
    payload = b"".join(bytes(s) for s in message.segments())
    header = make_header(delivered_by, b"recipient", payload, kind=message.kind, round=message.round,
                         tensors=message.manifest(), meta=dict(message.meta))
    return ReceivedMessage(delivered_by.peer_id, header, message.manifest(), memoryview(payload))


def sign_frame(signer: NodeIdentity, header: MessageHeader | bytes, payload: bytes = b"") -> bytes:
    """A complete frame: `header` (a MessageHeader or raw header bytes) signed by `signer`."""
    raw = header if isinstance(header, bytes) else encode_header(header)
    return frame_prefix(raw, signer.sign(signing_input(raw))) + payload


def make_frame(author: NodeIdentity, to: bytes, payload: bytes = b"", signer: NodeIdentity | None = None,
               **overrides: Any) -> bytes:
    """A complete signed frame (signed by `signer`, default `author`)."""
    return sign_frame(signer or author, make_header(author, to, payload, **overrides), payload)


def run(coroutine: Awaitable[T], timeout_s: float = 60.0) -> T:
    """Run a test coroutine on uvloop with a hard deadline, so a hang fails instead of stalling."""
    import uvloop

    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await coroutine
    return uvloop.run(bounded())


async def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    """Poll an async predicate until it returns a truthy value; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(interval_s)


async def _member_main(data_dir: str, swarm: str, ttl_s: float, initial_peer: str) -> None:
    from p2p.host import P2PHost, p2pd_socket_paths
    from p2p.membership import Membership

    identity = NodeIdentity.load_or_create(identity_path(data_dir))
    host = await P2PHost.start(identity, initial_peers=[initial_peer])
    membership = Membership(host, swarm, protocol="noloco", manifest=MANIFEST, ttl_s=ttl_s,
                            heartbeat_s=ttl_s / 4)
    await membership.start()
    own = [str(host.p2p._client_listen_maddr["unix"])]
    print(json.dumps({"peer_id": host.peer_id.to_base58(), "p2pd_pid": host.p2p._child.pid,
                      "p2pd_sockets": [p for p in p2pd_socket_paths(host.p2p) if p not in own],
                      "own_sockets": own}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        with suppress(Exception):
            await host.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "member":
        sys.exit("usage: python -m tests.p2p_helpers member DATA_DIR SWARM TTL INITIAL_PEER")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import uvloop
    uvloop.run(_member_main(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))
