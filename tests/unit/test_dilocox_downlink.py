"""A DiLoCoX node's downlink load (node/rounds/dilocox/downlink.py): measured from the messages
that come, published in its record, and held to by every member that sends to it."""

import asyncio
import math
import random

import pytest

from node.config.manifest import ProtocolSection
from node.rounds.dilocox.downlink import MIN_BYTES, RECORD_KEY, DownlinkMeter, receiver_load
from node.rounds.dilocox.exchange import DiLoCoXExchange
from node.rounds.dilocox.sending import LINK_MEMORY
from tests.swarm_parts import member as live_member
from tests.swarm_parts import unit_swarm

KB = 1000


def member(peer_id: str, **extra):
    return live_member(peer_id, 0, "dilocox", "training", since=0, **extra)


def test_a_rounds_load_is_its_bytes_at_the_fastest_rate_its_messages_came():
    """Three 400 KB messages, one alone at 100 KB/s, two sharing the link or from a slow sender
    at 25 KB/s, and 2 KB: the link carries 100 KB/s, the round needs 12.02 s of it, 1.5 rounds
    of 8 s."""
    meter = DownlinkMeter()
    meter.arrived(7, 400 * KB, 4.0)
    meter.arrived(7, 400 * KB, 16.0)
    meter.arrived(7, 400 * KB, 16.0)
    meter.arrived(7, 2 * KB, 0.001)  # small: its seconds are latency, not the link's rate
    assert meter.collected(7, 8.0) == pytest.approx(1202 / 100 / 8)
    assert meter.load == pytest.approx(1202 / 100 / 8)


def test_messages_that_share_the_downlink_measure_it_together():
    """R14's slow node: three 400 KB messages coming at once through 64 KB/s, each at a third
    of it. Read one at a time the link would look three times slower than it is, and its
    senders would compress three times harder than it needs."""
    meter = DownlinkMeter()
    for _ in range(3):
        meter.arrived(0, 400 * KB, 18.75, at=100.0)
    assert meter.collected(0, 12.0) == pytest.approx(1200 / 64 / 12)


def test_a_slow_senders_message_does_not_count_against_a_fast_receivers_link():
    """A fast node receives two 200 KB messages in 0.1 s and the slow node's 100 KB in 4.7 s (that
    node's uplink): its downlink is idle, whatever the slow sender's message took."""
    meter = DownlinkMeter()
    meter.arrived(0, 200 * KB, 0.1, at=100.1)
    meter.arrived(0, 200 * KB, 0.1, at=100.1)
    meter.arrived(0, 100 * KB, 4.7, at=104.7)
    assert meter.collected(0, 12.0) == pytest.approx(500 / 2000 / 12)


def test_no_load_before_a_large_message_measured_the_link():
    meter = DownlinkMeter()
    meter.arrived(0, MIN_BYTES - 1, 0.001)  # would read as a 32 MB/s link
    meter.arrived(0, 100 * KB, 0.0)         # not over a stream
    assert meter.collected(0, 1.0) is None and meter.load is None
    meter.arrived(1, MIN_BYTES, 1.0)
    assert meter.collected(1, 0.0) is None  # no round measured yet


def test_the_published_load_is_the_worst_of_the_last_rounds():
    """As the senders' own cost (sending.py LINK_MEMORY): a round whose messages were small does
    not let every sender grow onto the downlink at once."""
    meter = DownlinkMeter()
    meter.arrived(0, 1000 * KB, 10.0)  # 100 KB/s; the round needs 10 s of 5
    assert meter.collected(0, 5.0) == pytest.approx(2.0)
    for r in range(1, LINK_MEMORY):
        meter.arrived(r, 100 * KB, 1.0)
        assert meter.collected(r, 5.0) == pytest.approx(0.2)
        assert meter.load == pytest.approx(2.0)
    meter.arrived(LINK_MEMORY, 100 * KB, 1.0)
    meter.collected(LINK_MEMORY, 5.0)
    assert meter.load == pytest.approx(0.2)


def test_only_valid_loads_of_the_members_asked_for_count():
    records = [member("a", **{RECORD_KEY: 0.3}), member("b", **{RECORD_KEY: 0.9}),
               member("c", **{RECORD_KEY: "2"}), member("d", **{RECORD_KEY: math.nan}),
               member("e", **{RECORD_KEY: -1}), member("f", **{RECORD_KEY: 1e9}),
               member("g", **{RECORD_KEY: True}), member("h")]
    assert receiver_load(records, {"a", "c", "d", "e", "f", "g", "h"}) == 0.3
    assert receiver_load(records, {"a", "b"}) == 0.9
    assert receiver_load(records, {"h"}) == 0.0


def test_a_sender_holds_its_sends_to_its_busiest_receivers_downlink():
    """R14: each fast node's own sends were within budget while the slow member's downlink carried
    18 s of their messages a 12 s round. The member's published load is the senders' ratio when
    it is the larger; our own published load is not (our messages do not cross our downlink)."""
    async def main():
        loop = asyncio.get_running_loop()
        records = [member("me", **{RECORD_KEY: 5.0}), member("fast", **{RECORD_KEY: 0.05}),
                   member("slow", **{RECORD_KEY: 1.5})]
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), unit_swarm(loop, records),
                             random.Random(0))
        ex.sender._link_costs, ex.sender._handed_bytes = (1e-5,), 100_000  # 1 s to send
        ex.sender._round_durations = (10.0,)
        assert ex.send_ratio() == pytest.approx(0.1)  # before any round was collected
        ex.downlink.arrived(0, 200 * KB, 1.0)
        ex._measure_downlinks(0)
        assert ex.send_ratio() == pytest.approx(1.5)
        ex.members.records["slow"] = member("slow", **{RECORD_KEY: 0.2})
        ex._measure_downlinks(1)
        assert ex.send_ratio() == pytest.approx(0.2)

        # and ours is published with the round: 200 KB at 200 KB/s over a 10 s round
        ex._after_round(0, "digest")
        await asyncio.sleep(0)
        published = ex.members.membership.updates[-1]
        assert published["round"] == 1 and published["extra"][RECORD_KEY] == pytest.approx(0.1)
        ex.consensus.checks.pop(0).cancel()
    asyncio.run(main())
