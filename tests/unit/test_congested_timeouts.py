"""A stream idle for its whole timeout while our other streams filled our downlink is our link's
fault, not the peer's: it is refused TIMEOUT all the same, but strikes no one (p2p/progress.py).
A node on 512 kbit/s banned its three honest members for 600 s this way."""

import asyncio

import pytest

from p2p.counters import TransportCounters
from p2p.errors import Reason, Refusal
from p2p.framing import StreamIO
from p2p.progress import CONGESTED_BYTES


async def idle_read(counters: TransportCounters, arriving_elsewhere: int, payload: bool) -> Refusal:
    reader = asyncio.StreamReader()  # nothing ever arrives on this stream
    io = StreamIO(reader, writer=None, counters=counters, stall_s=0.3)

    async def other_streams() -> None:
        await asyncio.sleep(0.1)
        counters.bytes_received += arriving_elsewhere
    task = asyncio.create_task(other_streams())
    with pytest.raises(Refusal) as refused:
        if payload:
            await io.read_payload_into(memoryview(bytearray(1000)), bytes(32))
        else:
            await io.read_exactly(10)
    await task
    return refused.value


@pytest.mark.parametrize("payload", [False, True])
def test_a_stream_idle_while_others_filled_the_link_is_congestion(payload):
    refusal = asyncio.run(idle_read(TransportCounters(), CONGESTED_BYTES, payload))
    assert refusal.reason is Reason.TIMEOUT and refusal.congested
    assert "our link is saturated" in refusal.detail


@pytest.mark.parametrize("payload", [False, True])
def test_a_stream_idle_on_a_quiet_link_is_the_peers_stall(payload):
    refusal = asyncio.run(idle_read(TransportCounters(), CONGESTED_BYTES - 1, payload))
    assert refusal.reason is Reason.TIMEOUT and not refusal.congested


def test_a_congested_refusal_is_counted_but_strikes_no_one():
    struck: list = []
    counters = TransportCounters(on_refusal_issued=lambda peer, reason: struck.append(peer))
    counters.count_refusal_issued(Reason.TIMEOUT, "honest", congested=True)
    counters.count_refusal_issued(Reason.TIMEOUT, "staller")
    assert struck == ["staller"]
    assert counters.refused_incoming["TIMEOUT"] == 2 and counters.refused_congested == 1
