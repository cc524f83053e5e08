"""How long a pushing sender waits between drains: on loopback behind a slow reader, and over a
shaped link (the premise of tests/integration/test_transfer_progress.py's long push).

    flock /tmp/lowcomm-heavy.lock .venv/bin/python benchmarks/drain_gaps.py --runs 3
    flock /tmp/lowcomm-heavy.lock .venv/bin/python -m pytest -s -p benchmarks.drain_gaps \\
        tests/integration/test_transfer_progress.py -k outlasts

Run as a script: two hosts on loopback; the receiver is a hand-written end of the p2pd stream
that reads 8 KiB each 20 ms (about 400 kB/s); the sender (the real Transport, a 30 s stall bound
so that nothing is cut) pushes `--bytes` in one frame after a first small push opens the
connection. Printed per run: the longest time between two drain returns of the sender's stream,
when it began, and how many bytes the sender had written then against how many the reader had
read (the bytes held in the buffers between them).

As a pytest plugin (`-p benchmarks.drain_gaps`): every push of over 1 MB written through
`StreamIO.write_views` is timed the same way; printed at the end of the session.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import p2p.framing as framing

_gaps: list[tuple[int, int, float, float]] = []   # (bytes, drains, longest gap s, span s)
_write_views = framing.StreamIO.write_views


async def _timed_write_views(self, views, chunk_bytes):
    views = list(views)
    total = sum(len(v) for v in views)
    if total <= 10**6:
        return await _write_views(self, views, chunk_bytes)
    drain, times = self._drain, [time.monotonic()]

    async def timed_drain():
        await drain()
        times.append(time.monotonic())
    self._drain = timed_drain
    try:
        return await _write_views(self, views, chunk_bytes)
    finally:
        del self._drain
        gaps = [b - a for a, b in zip(times, times[1:])]
        _gaps.append((total, len(gaps), max(gaps, default=0.0), times[-1] - times[0]))


def pytest_configure(config):
    framing.StreamIO.write_views = _timed_write_views


def pytest_sessionfinish(session):
    for total, drains, longest, span in _gaps:
        print(f"\npush of {total} B: {drains} drains over {span:.2f} s, longest gap {longest:.3f} s")


async def _loopback_run(base: Path, size: int) -> str:
    import numpy as np

    from p2p.counters import TransportCounters
    from p2p.errors import Reason
    from p2p.limits import KiB, TransferLimits, WireLimits
    from p2p.messages import OutgoingMessage
    from p2p.serving import STREAM_PROTOCOL
    from p2p.streams import Transport
    from p2p.wire import decode_header_bytes
    from tests.integration.conftest import P2PCleanup
    from tests.p2p_helpers import MANIFEST, SWARM

    reads: list[tuple[float, int]] = []
    drains: list[tuple[float, int]] = []

    async def slow_reader(info, reader, writer):
        io = framing.StreamIO(reader, writer, TransportCounters(), stall_s=60.0)
        raw, _ = await io.read_frame_head(256 * KiB)
        left = decode_header_bytes(raw, WireLimits()).length
        while left:
            left -= len(await io.read_exactly(min(8 * KiB, left)))
            reads.append((time.monotonic(), size - left))
            await asyncio.sleep(0.02)
        await io.write_status(Reason.OK)
        await io.linger()

    cleanup = P2PCleanup()
    drain = framing.StreamIO._drain

    async def recorded_drain(self):
        await drain(self)
        if self.progress.sending > size // 2:  # the sender's big push, not a status
            drains.append((time.monotonic(), self.progress.sent))
    framing.StreamIO._drain = recorded_drain
    try:
        async with cleanup.hosts(base, 2) as (a, b):
            sender = Transport(a.p2p, a.identity, swarm=SWARM, manifest=MANIFEST,
                               limits=TransferLimits(stall_s=30.0, chunk_bytes=64 * KiB))
            await b.p2p.add_binary_stream_handler(STREAM_PROTOCOL, slow_reader)
            await sender.start()
            await sender.push(b.peer_id, OutgoingMessage.from_arrays("test", 1, {"x": np.ones(8, np.uint8)}))
            reads.clear()
            began = time.monotonic()
            message = OutgoingMessage.from_arrays("test", 1, {"x": np.ones(size, np.uint8)})
            await sender.push(b.peer_id, message, streams=1)
            took = time.monotonic() - began
            await sender.stop()
    finally:
        framing.StreamIO._drain = drain
        cleanup.finish()
    marks = [(began, 0), *drains]
    gap, (start, sent) = max(((b[0] - a[0], a) for a, b in zip(marks, marks[1:])), key=lambda g: g[0])
    read = max((n for t, n in reads if t <= start), default=0)
    return (f"push of {size} B in {took:.2f} s: {len(drains)} drains, longest gap {gap:.2f} s from "
            f"{start - began:.2f} s, when the sender had written {sent} B and the reader read {read} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=4 * 10**6)
    args = parser.parse_args()
    import uvloop
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="drain-gaps-") as base:
            print(uvloop.run(_loopback_run(Path(base), args.bytes)), flush=True)


if __name__ == "__main__":
    main()
