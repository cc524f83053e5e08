"""Transfers between real peers end when done, stalled or too slow, never at a fixed time
(p2p/progress.py): a push that keeps moving outlasts its stall bound many times and completes; a
sender that stops mid-way, a receiver that stops reading, and a sender trickling a byte at a time
are each given up with a one-sentence reason, the receiver's buffers released.

The pushing node and the receiver of the long push are real Transports, the receiver in a network
namespace behind a shaped link (needs root, like the other host_network files); the slow peers of
the other tests are hand-written ends of a real p2pd stream on loopback (the frames they send are
signed like any other), the node's side the real Transport."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
from hivemind.p2p import PeerID

from p2p.counters import TransportCounters
from p2p.errors import Reason, TransferFailed
from p2p.framing import StreamIO
from p2p.limits import KiB, TransferLimits, WireLimits
from p2p.messages import OutgoingMessage
from p2p.serving import STREAM_PROTOCOL
from p2p.streams import Transport
from p2p.wire import decode_header_bytes, encode_header, frame_prefix, signing_input
from tests import netns_link
from tests.p2p_helpers import MANIFEST, SWARM, make_header, read_line, run, wait_until

# the push test's receiver sits behind a veth pair on the host (the other tests stay on loopback)
pytestmark = [pytest.mark.integration, pytest.mark.host_network]
STALL_S = 1.0
MB = 10**6
REPO = Path(__file__).resolve().parents[2]
LINK, LINK_BYTES_PER_S = "3200kbit", 400_000
# the long push's stall bound (the other tests use STALL_S): well above its sender's longest wait
# between drains over LINK (benchmarks/RESULTS.md, "Drain gaps of a push over a 3.2 Mbit/s link")
PUSH_STALL_S = 2.0
PUSH_BYTES = 4 * MB              # 10 s over LINK: five of its stall bounds
RECEIVER_START_S = 30            # a bound on the receiver process's start, not a measurement


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


@pytest.fixture
def shaped_link():
    """A namespace behind a veth pair shaped to LINK each way (tests/netns_link.py); removed
    after the test, failed or not. Requested before `p2p_cleanup`, so that the receiver running
    in it is killed (that fixture's teardown) before the namespace goes."""
    with netns_link.NamespaceLink() as link:
        link.shape(LINK)
        yield link


@pytest.mark.skipif(netns_link.available() is not None, reason=str(netns_link.available()))
def test_a_push_that_keeps_moving_outlasts_its_stall_bound_and_completes(tmp_path, shaped_link, p2p_cleanup):
    """The receiver (tests/p2p_helpers.py receiver: a real Transport) sits in a namespace behind
    a LINK link, as a volunteer on a home line does; the sender pushes PUSH_BYTES over it with a
    PUSH_STALL_S stall bound. The link paces the push (PUSH_BYTES / LINK_BYTES_PER_S: several
    stall bounds), bytes drain many times a stall bound, and the answer comes once the last byte,
    still in the link's buffers when the sender wrote it, has arrived: neither is a stall, and the
    push completes.

    Not a slow reader on loopback: there the sender's bytes vanish by megabytes into the buffers
    on the way (go-yamux grows a stream's receive window) and then nothing drains for seconds
    while the reader reads (benchmarks/RESULTS.md, "Drain gaps of a push over a 3.2 Mbit/s
    link"); over a link the receiver reads at once, and the link's pace reaches the sender."""
    link = shaped_link

    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 1, host_maddrs=[link.host_listen]) as (a,):
            ta = transport(a, TransferLimits(stall_s=PUSH_STALL_S, chunk_bytes=64 * KiB,
                                             min_rate_bytes_per_s=100_000.0))
            await ta.start()
            initial = next(m for m in await a.maddrs() if f"/{link.host_address}/" in m)
            receiver = p2p_cleanup.track_process(subprocess.Popen(
                ["ip", "netns", "exec", link.namespace, sys.executable, "-m", "tests.p2p_helpers",
                 "receiver", str(tmp_path / "receiver"), "--listen", link.inner_listen,
                 "--initial-peer", initial, "--stall-s", str(PUSH_STALL_S)],
                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            try:
                started = json.loads(await read_line(receiver, RECEIVER_START_S))
                p2p_cleanup.track_pid(started["p2pd_pid"], started["p2pd_sockets"])
                p2p_cleanup.track_killed(started["own_sockets"])
                peer = PeerID.from_base58(started["peer_id"])
                # a first small push opens the connection (dial, identify) before the clock starts
                await ta.push(peer, OutgoingMessage.from_arrays("test", 1, {"x": np.ones(8, np.uint8)}),
                              streams=1)
                assert json.loads(await read_line(receiver, 10))["received"] == 8
                payload = np.random.default_rng(0).integers(0, 256, PUSH_BYTES, dtype=np.uint8)
                began = time.monotonic()
                await ta.push(peer, OutgoingMessage.from_arrays("test", 1, {"x": payload}), streams=1)
                took = time.monotonic() - began
                got = json.loads(await read_line(receiver, 10))
                assert got == {"received": PUSH_BYTES, "sha256": hashlib.sha256(payload).hexdigest()}
                # the link paced it: it lasted several stall bounds, about its bytes at the link's rate
                assert took > 4 * PUSH_STALL_S and took > 0.8 * PUSH_BYTES / LINK_BYTES_PER_S, took
                await ta.stop()
            finally:
                receiver.stdin.close()  # it stops cleanly, its p2pd and sockets with it (else the
                with suppress(subprocess.TimeoutExpired):  # fixture kills it and names the sockets)
                    await asyncio.get_running_loop().run_in_executor(None, receiver.wait, 20)
    run(scenario(), timeout_s=90)


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
