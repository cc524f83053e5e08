"""Shared helpers for the p2p tests: hand-made frames, hosts on loopback, and two node processes.

Run as a module, this file is one of two processes that integration tests start:

    python -m tests.p2p_helpers member DATA_DIR SWARM TTL INITIAL_PEER
    python -m tests.p2p_helpers receiver DATA_DIR --listen MADDR --initial-peer MADDR [--stall-s S]

`member` (the node that tests SIGKILL) prints one JSON line (peer id, p2pd pid, p2pd's unix
sockets, and its own: the client socket hivemind listens on for p2pd) once its membership record
is stored, then serves until killed. `receiver` (a node that tests run in a network namespace,
behind a shaped link) is a real Transport taking pushes of kind "test": it prints the same line
once it serves, then one JSON line per message delivered ({"received": payload bytes, "sha256":
its digest}), and stops cleanly, its p2pd and sockets gone, when its stdin closes or on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import subprocess
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


async def read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The next stdout line of a process started with stdout=PIPE, text=True, within `timeout_s`
    (the reading thread ends when the process does)."""
    async with asyncio.timeout(timeout_s):
        line = await asyncio.get_running_loop().run_in_executor(None, process.stdout.readline)
    if not line:
        raise AssertionError(f"process {process.pid} exited with {process.poll()} before its next line")
    return line


def _process_line(host) -> str:
    """The JSON line a node process prints once it serves (module docstring)."""
    from p2p.host import p2pd_socket_paths
    own = [str(host.p2p._client_listen_maddr["unix"])]
    return json.dumps({"peer_id": host.peer_id.to_base58(), "p2pd_pid": host.p2p._child.pid,
                       "p2pd_sockets": [p for p in p2pd_socket_paths(host.p2p) if p not in own],
                       "own_sockets": own})


async def _member_main(data_dir: str, swarm: str, ttl_s: float, initial_peer: str) -> None:
    from p2p.host import P2PHost
    from p2p.membership import Membership

    identity = NodeIdentity.load_or_create(identity_path(data_dir))
    host = await P2PHost.start(identity, initial_peers=[initial_peer])
    membership = Membership(host, swarm, protocol="noloco", manifest=MANIFEST, ttl_s=ttl_s,
                            heartbeat_s=ttl_s / 4)
    await membership.start()
    print(_process_line(host), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        with suppress(Exception):
            await host.shutdown()


async def _receiver_main(data_dir: str, listen: str, initial_peer: str, stall_s: float) -> None:
    from p2p.host import P2PHost
    from p2p.limits import TransferLimits
    from p2p.reachability import ReachabilityOptions
    from p2p.streams import Transport

    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.buffer.read1(4096) or stop.set())

    async def deliver(message: ReceivedMessage) -> None:
        print(json.dumps({"received": len(message.payload),
                          "sha256": hashlib.sha256(message.payload).hexdigest()}), flush=True)

    identity = NodeIdentity.load_or_create(identity_path(data_dir))
    # public: the test's peer dials it directly on the link (no dial-back probe, no relay wait)
    host = await P2PHost.start(identity, host_maddrs=[listen], initial_peers=[initial_peer],
                               reachability=ReachabilityOptions(mode="public"))
    transport = Transport(host.p2p, identity, swarm=SWARM, manifest=MANIFEST,
                          limits=TransferLimits(stall_s=stall_s))
    try:
        transport.on_push("test", deliver, accept_round=lambda r: True)
        await transport.start()
        print(_process_line(host), flush=True)
        await stop.wait()
    finally:
        with suppress(Exception):
            await transport.stop()
        await host.shutdown()


def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.p2p_helpers",
                                     description="node processes for the integration tests")
    commands = parser.add_subparsers(dest="command", required=True)
    member = commands.add_parser("member", help="a member that stores its record, until killed")
    member.add_argument("data_dir")
    member.add_argument("swarm")
    member.add_argument("ttl_s", type=float)
    member.add_argument("initial_peer")
    receiver = commands.add_parser("receiver", help="a Transport taking pushes, until stdin closes")
    receiver.add_argument("data_dir")
    receiver.add_argument("--listen", required=True, help="multiaddr to listen on, e.g. /ip4/10.79.0.2/tcp/0")
    receiver.add_argument("--initial-peer", required=True, help="a DHT node's full multiaddr")
    receiver.add_argument("--stall-s", type=float, default=30.0, help="the receiver's stall bound")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import uvloop
    if args.command == "member":
        uvloop.run(_member_main(args.data_dir, args.swarm, args.ttl_s, args.initial_peer))
    else:
        uvloop.run(_receiver_main(args.data_dir, args.listen, args.initial_peer, args.stall_s))


if __name__ == "__main__":
    _main(sys.argv[1:])
