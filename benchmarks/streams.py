"""Signed streams (issue 4): our signed transfer vs hivemind's raw binary stream vs plain TCP.

    .venv/bin/python benchmarks/streams.py              # loopback, 100 MB, median of 3
    .venv/bin/python benchmarks/streams.py --two-processes   # loopback, each peer in its own process
    .venv/bin/python benchmarks/streams.py --shaped     # netns + tbf 100 Mbit + 50 ms each way (root)

Every path moves the same bytes into a preallocated receive buffer and ends with an
acknowledgement from the receiver (one byte for raw and TCP, a status frame for ours), so a
timing covers delivery, not just sending:
  tcp        asyncio streams over a TCP socket, 1 MiB writes
  raw-1      hivemind binary stream (call_binary_stream_handler), 1 MiB writes, nothing signed
  raw-N      the same payload split over N parallel binary streams
  signed-1   p2p.streams.Transport.push on 1 stream: signed frames, BLAKE2b, every check
  signed-N   the same over N parallel streams (the default for large messages)

Loopback mode runs both peers, their two p2pd and the TCP reference in one process and one
uvloop, and interleaves the paths run by run, so that load from other processes on a shared
machine hits every path alike; ratios are more trustworthy than absolute MB/s there.
Shaped mode runs each peer in its own network namespace (benchmarks/netns.py): tbf at --rate
on both veth ends and a delaying relay (+--delay-ms each way) in front of the receiver's p2pd
and TCP listener; the sender reaches the receiver only through the relay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from hivemind.p2p import PeerID

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p.host import P2PHost, run_event_loop  # noqa: E402
from p2p.identity import NodeIdentity, identity_path  # noqa: E402
from p2p.messages import OutgoingMessage  # noqa: E402
from p2p.streams import Transport  # noqa: E402

CHUNK = 1 << 20
RAW_PROTOCOL = "/lowcomm/bench/raw"
LENGTH = struct.Struct(">Q")
SWARM = "bench"


async def receive_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The raw and TCP receiver: length, then bytes into a preallocated buffer, then b"k"."""
    try:
        (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        buffer = np.empty(size, dtype=np.uint8)
        view, filled = memoryview(buffer), 0
        while filled < size:
            chunk = await reader.readexactly(min(CHUNK, size - filled))
            view[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
        writer.write(b"k")
        await writer.drain()
    finally:
        writer.close()


async def send_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: memoryview) -> None:
    writer.write(LENGTH.pack(len(data)))
    for start in range(0, len(data), CHUNK):
        writer.write(data[start:start + CHUNK])
        await writer.drain()
    assert await reader.readexactly(1) == b"k"
    writer.close()


async def start_receiver(host: P2PHost, tcp_host: str, tcp_port: int):
    """Raw, TCP and signed receivers on `host`; returns (transport, tcp server)."""
    await host.p2p.add_binary_stream_handler(RAW_PROTOCOL, lambda info, r, w: receive_raw(r, w))
    server = await asyncio.start_server(receive_raw, tcp_host, tcp_port)
    transport = Transport(host.p2p, host.identity, swarm=SWARM, manifest=SWARM)

    async def deliver(message):
        assert len(message.payload) > 0
    transport.on_push("bench", deliver, accept_round=lambda r: True)
    await transport.start()
    return transport, server


def sender_paths(host: P2PHost, transport: Transport, peer, tcp_address: tuple[str, int], view: memoryview,
                 streams: int) -> dict:
    def message():  # a new message per transfer: a reused one would skip hashing (digests are cached)
        return OutgoingMessage.from_arrays("bench", 0, {"payload": np.frombuffer(view, dtype=np.uint8)})

    async def tcp():
        reader, writer = await asyncio.open_connection(*tcp_address)
        await send_raw(reader, writer, view)

    async def raw(n):
        bounds = np.linspace(0, len(view), n + 1).astype(int)

        async def one(start, stop):
            _, reader, writer = await host.p2p.call_binary_stream_handler(peer, RAW_PROTOCOL)
            await send_raw(reader, writer, view[start:stop])
        await asyncio.gather(*(one(bounds[i], bounds[i + 1]) for i in range(n)))

    return {"tcp": tcp, "raw-1": lambda: raw(1), f"raw-{streams}": lambda: raw(streams),
            "signed-1": lambda: transport.push(peer, message(), streams=1),
            f"signed-{streams}": lambda: transport.push(peer, message(), streams=streams)}


async def time_paths(paths: dict, repeats: int, warmup: bool = True) -> dict[str, float]:
    """Median seconds per path; paths interleaved run by run."""
    async def run(name, path):
        try:
            await path()
        except Exception as error:
            raise RuntimeError(f"path {name} failed: {type(error).__name__}: {error}") from error

    if warmup:  # connections, handlers, the first page faults of the buffers
        for name, path in paths.items():
            await run(name, path)
    times = {name: [] for name in paths}
    for _ in range(repeats):
        for name, path in paths.items():
            start = time.perf_counter()
            await run(name, path)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


async def run_loopback(size_mb: int, repeats: int, streams: int) -> dict:
    payload = np.random.default_rng(0).integers(0, 256, size_mb * 10**6, dtype=np.uint8)
    work = tempfile.mkdtemp(prefix="lowcomm-bench-")  # the two keys; removed at the end
    ids = [NodeIdentity.load_or_create(identity_path(f"{work}/{i}")) for i in range(2)]
    a = await P2PHost.start(ids[0])
    b = await P2PHost.start(ids[1], initial_peers=await a.maddrs())
    try:
        receiver, server = await start_receiver(b, "127.0.0.1", 0)
        sender = Transport(a.p2p, ids[0], swarm=SWARM, manifest=SWARM)
        await sender.start()
        tcp_address = ("127.0.0.1", server.sockets[0].getsockname()[1])
        paths = sender_paths(a, sender, b.peer_id, tcp_address, memoryview(payload), streams)
        medians = await time_paths(paths, repeats)
        server.close()
        await sender.stop()
        await receiver.stop()
    finally:
        await a.shutdown()
        await b.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return medians | {"_bytes": payload.nbytes}


async def run_side(args) -> None:
    """One peer of the shaped benchmark, inside its namespace."""
    work = tempfile.mkdtemp(prefix=f"lowcomm-bench-{args.side}-")
    try:
        await _run_side(args, NodeIdentity.load_or_create(identity_path(work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _run_side(args, identity: NodeIdentity) -> None:
    if args.side == "receiver":
        host = await P2PHost.start(identity, host_maddrs=[f"/ip4/127.0.0.1/tcp/{args.p2p_port}"])
        try:
            transport, server = await start_receiver(host, "127.0.0.1", args.tcp_port)
            print(json.dumps({"peer_id": host.peer_id.to_base58()}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
            server.close()
            await transport.stop()
        finally:
            await host.shutdown()
        return
    host = await P2PHost.start(identity, initial_peers=[args.peer])
    try:
        transport = Transport(host.p2p, identity, swarm=SWARM, manifest=SWARM)
        await transport.start()
        payload = np.random.default_rng(0).integers(0, 256, args.size_mb * 10**6, dtype=np.uint8)
        peer = PeerID.from_base58(args.peer.rsplit("/p2p/", 1)[1])
        tcp_host, tcp_port = args.tcp.rsplit(":", 1)
        paths = sender_paths(host, transport, peer, (tcp_host, int(tcp_port)), memoryview(payload), args.streams)
        small = {name: path for name, path in sender_paths(host, transport, peer, (tcp_host, int(tcp_port)),
                                                           memoryview(payload[:1 << 20]), args.streams).items()}
        await time_paths(small, 1, warmup=False)  # open every connection before timing
        medians = await time_paths(paths, args.repeats, warmup=False)
        print(json.dumps(medians | {"_bytes": payload.nbytes}), flush=True)
        await transport.stop()
    finally:
        await host.shutdown()


def apply_what_if_digest(name: str | None) -> None:
    """An experiment, not a protocol option: swap the payload digest to see what it costs.

    "blake3" uses the blake3 package (present as a dependency of py-multihash), "none" a no-op;
    both peers of a run must use the same. Results are labelled with the flag in the command.
    """
    from p2p import wire
    if name == "blake3":
        import blake3
        wire.new_payload_hasher = blake3.blake3
    elif name == "none":
        class NoDigest:
            def update(self, data):
                pass

            def digest(self):
                return bytes(wire.DIGEST_BYTES)
        wire.new_payload_hasher = NoDigest


def run_two_processes(args) -> dict:
    """Loopback, but each peer in its own process, as real nodes are (no shared GIL)."""
    python, me = sys.executable, str(ROOT / "benchmarks" / "streams.py")
    p2p_port, tcp_port = _free_port(), _free_port()
    what_if = ["--what-if-digest", args.what_if_digest] if args.what_if_digest else []
    receiver = subprocess.Popen([python, me, "--side", "receiver", "--p2p-port", str(p2p_port),
                                 "--tcp-port", str(tcp_port), *what_if],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        peer_id = json.loads(receiver.stdout.readline())["peer_id"]
        sender = subprocess.run([python, me, "--side", "sender", "--peer",
                                 f"/ip4/127.0.0.1/tcp/{p2p_port}/p2p/{peer_id}", "--tcp", f"127.0.0.1:{tcp_port}",
                                 "--size-mb", str(args.size_mb), "--repeats", str(args.repeats),
                                 "--streams", str(args.streams), *what_if], stdout=subprocess.PIPE, text=True,
                                timeout=1200)
    finally:
        receiver.stdin.close()
        try:
            receiver.wait(timeout=30)
        except subprocess.TimeoutExpired:
            receiver.kill()
    lines = [line for line in sender.stdout.splitlines() if line.startswith("{")]
    if sender.returncode != 0 or not lines:
        raise RuntimeError(f"the sender process failed (exit {sender.returncode}); see its stderr above.")
    return json.loads(lines[-1])


def _free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_shaped(args) -> dict:
    from benchmarks.netns import ShapedLink
    python, me, relay = sys.executable, str(ROOT / "benchmarks" / "streams.py"), str(ROOT / "benchmarks" / "netns.py")
    with ShapedLink(rate=args.rate) as link:
        for listen, target in ((4001, 4000), (4101, 4100)):
            started = link.popen(link.b, [python, relay, "relay", "--listen", f"{link.addr_b}:{listen}",
                                          "--target", f"127.0.0.1:{target}", "--delay-ms", str(args.delay_ms)],
                                 stdout=subprocess.PIPE, text=True)
            assert started.stdout.readline().startswith("relay"), "the delaying relay did not start"
        receiver = link.popen(link.b, [python, me, "--side", "receiver", "--p2p-port", "4000", "--tcp-port", "4100"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        peer_id = json.loads(receiver.stdout.readline())["peer_id"]
        sender = link.popen(link.a, [python, me, "--side", "sender", "--peer",
                                     f"/ip4/{link.addr_b}/tcp/4001/p2p/{peer_id}", "--tcp", f"{link.addr_b}:4101",
                                     "--size-mb", str(args.size_mb), "--repeats", str(args.repeats),
                                     "--streams", str(args.streams)], stdout=subprocess.PIPE, text=True)
        output, _ = sender.communicate(timeout=1200)
        receiver.stdin.close()
        lines = [line for line in output.splitlines() if line.startswith("{")]
        if sender.returncode != 0 or not lines:
            raise RuntimeError(f"the sender side failed (exit {sender.returncode}); see its stderr above.")
        return json.loads(lines[-1])


def report(medians: dict, streams: int, command: str, link_mbit: float | None = None) -> str:
    medians = dict(medians)
    size = medians.pop("_bytes")
    rate = {name: size / t for name, t in medians.items()}   # bytes per second
    head = "| path | median s | MB/s | Mbit/s | vs raw-1 | vs raw-{0} | vs tcp |".format(streams)
    lines = [head + (" % of link |" if link_mbit else ""), "|---" * (7 + bool(link_mbit)) + "|"]
    for name in medians:
        row = (f"| {name} | {medians[name]:.3f} | {rate[name] / 1e6:.1f} | {rate[name] * 8 / 1e6:.1f} | "
               f"{rate[name] / rate['raw-1']:.2f} | {rate[name] / rate[f'raw-{streams}']:.2f} | "
               f"{rate[name] / rate['tcp']:.2f} |")
        lines.append(row + (f" {100 * rate[name] * 8 / 1e6 / link_mbit:.0f} % |" if link_mbit else ""))
    return "\n".join([f"`{command}` ({size / 1e6:.0f} MB per transfer)", "", *lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=None, help="default 100 (loopback), 40 (shaped)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--shaped", action="store_true", help="two network namespaces, tbf + delaying relay (root)")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--what-if-digest", choices=["blake3", "none"],
                        help="experiment: replace BLAKE2b to measure its cost (not a protocol option)")
    parser.add_argument("--two-processes", action="store_true", help="loopback with each peer in its own process")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--side", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--tcp", help=argparse.SUPPRESS)
    parser.add_argument("--p2p-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_what_if_digest(args.what_if_digest)
    if args.side:
        run_event_loop(run_side(args))
        return
    command = "python benchmarks/streams.py " + " ".join(sys.argv[1:])
    if args.shaped:
        args.size_mb = args.size_mb or 40
        medians = run_shaped(args)
        link_mbit = float(args.rate.removesuffix("mbit")) if args.rate.endswith("mbit") else None
    else:
        args.size_mb = args.size_mb or 100
        if args.two_processes:
            medians = run_two_processes(args)
        else:
            medians = run_event_loop(run_loopback(args.size_mb, args.repeats, args.streams))
        link_mbit = None
    print(json.dumps(medians) if args.json else report(medians, args.streams, command.strip(), link_mbit))


if __name__ == "__main__":
    main()
