"""DiLoCoXExchange's sender on the event loop, without a network: failed and retried pushes, and
how a send is timed against the round for the controller (tests/dilocox_parts.py builds the
swarm)."""

import asyncio
import random

import pytest

from node.config.manifest import ProtocolSection
from node.events import SendFailed
from node.rounds.dilocox.exchange import DiLoCoXExchange
from node.rounds.dilocox.sending import LINK_MEMORY, PGRAD
from p2p.errors import P2PError, Reason, RemoteRefused, TransferFailed, TransferTimeout
from p2p.limits import TransferLimits
from p2p.messages import OutgoingMessage
from tests.dilocox_parts import member
from tests.swarm_parts import unit_swarm
from tests.virtual_time import run as run_virtual


class FailingTransport:
    """One peer's push fails with the network's error, another's with any other error (a bound
    the send planner enforces raised ValueError, which escaped the send and vanished)."""
    limits = TransferLimits()  # the need-by of a push follows the transport's limits

    async def push(self, peer, message, need_by=None):
        if peer == "b":
            raise ValueError("the send planner failed")
        raise P2PError("the stream broke")


def test_a_send_failing_with_any_error_is_a_counted_send_failure():
    async def main():
        loop = asyncio.get_running_loop()
        events: list = []
        swarm = unit_swarm(loop, [member("a", 0), member("b", 0)], transport=FailingTransport(),
                           events=events)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        await ex.sender._send_all(0, OutgoingMessage("dilocox.pgrad", 0, []))
        failed = sorted((e.peer, e.error) for e in events if e.kind == "send_failed")
        assert failed == [("a", "the stream broke"), ("b", "ValueError: the send planner failed")]
        assert all(e.logged for e in events if e.kind == "send_failed")
        assert [e.kind for e in events][-1] == "sent" and ex.sender._sends_in_flight == {}
    run_virtual(main())


class TransportAtAFixedRate:
    """Pushes take 10 µs a byte: a link whose rate the test knows."""
    limits = TransferLimits()  # the need-by of a push follows the transport's limits

    async def push(self, peer, message, need_by=None):
        await asyncio.sleep(message.total_bytes * 1e-5)


def test_the_send_ratio_is_projected_for_the_message_just_handed_over():
    """The controller judges the message it just encoded: a send measured on a message half its
    size must report twice its ratio (the old measure reported the smaller one's, and the
    controller, a round behind, doubled the rank until the link saturated)."""
    import numpy as np

    async def main():
        loop = asyncio.get_running_loop()
        swarm = unit_swarm(loop, [member("a", 0)], transport=TransportAtAFixedRate())
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        small = OutgoingMessage.from_arrays("dilocox.pgrad", 0, {"w": np.zeros(10_000, np.uint8)})
        assert ex.costs().send_ratio is None  # nothing measured yet
        await ex.sender._send_all(0, small)  # 0.1 s
        ex.sender._round_durations, ex.sender._handed_bytes = (1.0,), 20_000
        assert ex.costs().send_ratio == pytest.approx(0.2)  # 10 µs a byte, 20 kB, a 1 s round
        ex.sender._handed_bytes = 10_000
        assert ex.costs().send_ratio == pytest.approx(0.1)
    run_virtual(main())


class TransportWithAFailingPeer(TransportAtAFixedRate):
    """As above, but peer "b" resets every push at once."""

    async def push(self, peer, message, need_by=None):
        if peer == "b":
            raise ConnectionResetError("reset by peer")
        await super().push(peer, message, need_by)


def test_a_send_that_fails_at_once_does_not_make_the_link_look_faster():
    """One slow node's resets read as instant sends let the fast nodes' controllers double the
    rank onto its saturated downlink (the heterogeneous time-to-loss run)."""
    import numpy as np

    async def main():
        loop = asyncio.get_running_loop()
        swarm = unit_swarm(loop, [member("a", 0), member("b", 0)], transport=TransportWithAFailingPeer())
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        big = OutgoingMessage.from_arrays("dilocox.pgrad", 0, {"w": np.zeros(10_000, np.uint8)})
        await ex.sender._send_all(0, big)  # 0.1 s to "a"; "b" fails
        ex.sender._round_durations, ex.sender._handed_bytes = (1.0,), 10_000
        before = ex.costs().send_ratio
        ex.members.records = {"b": member("b", 0)}  # a round whose only send fails at once
        await ex.sender._send_all(1, big)
        assert ex.costs().send_ratio == pytest.approx(before) == pytest.approx(0.1)
    run_virtual(main())


class TransportAtAChosenRate:
    """Each push takes `seconds` (a member's downlink that other senders share some rounds)."""
    limits = TransferLimits()  # the need-by of a push follows the transport's limits
    seconds = 0.1

    async def push(self, peer, message, need_by=None):
        await asyncio.sleep(self.seconds)


def test_one_fast_send_after_a_slow_one_does_not_make_the_link_look_fast():
    """A slow member's downlink carries every member's message: a round whose sends did not
    overlap there measured fast, and the controller doubled and halved the rank round after
    round (16-32-64). The link's cost is the worst of the last LINK_MEMORY sends."""
    import numpy as np

    async def main():
        loop = asyncio.get_running_loop()
        transport = TransportAtAChosenRate()
        swarm = unit_swarm(loop, [member("a", 0)], transport=transport)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        message = OutgoingMessage.from_arrays("dilocox.pgrad", 0, {"w": np.zeros(10_000, np.uint8)})
        transport.seconds = 0.2
        await ex.sender._send_all(0, message)
        ex.sender._round_durations, ex.sender._handed_bytes = (1.0,), 10_000
        slow = ex.costs().send_ratio
        assert slow == pytest.approx(0.2)
        transport.seconds = 0.02
        for r in range(1, LINK_MEMORY):
            await ex.sender._send_all(r, message)
            assert ex.costs().send_ratio == slow  # still within memory of the slow send
        await ex.sender._send_all(LINK_MEMORY, message)
        assert ex.costs().send_ratio == pytest.approx(slow / 10)  # forgotten after LINK_MEMORY faster sends
    run_virtual(main())


class TransportWithASlowReceiver:
    """Pushes to "slow" take 0.3 s, to the others 0.01 s (or all 0.3 s: our own uplink)."""
    limits = TransferLimits()  # the need-by of a push follows the transport's limits
    uplink_bound = False

    async def push(self, peer, message, need_by=None):
        await asyncio.sleep(0.3 if peer == "slow" or self.uplink_bound else 0.01)


def test_a_receiver_slower_than_the_others_bounds_the_growth_of_every_senders_message():
    """R14: a slow member's downlink carries a message from each of its N - 1 members: what our
    push to it took beyond the fastest receiver, three times over for three senders, is the
    ratio that holds the controller's moves up. A node whose own uplink is the bottleneck takes
    as long to every receiver and reads about 0."""
    import numpy as np

    async def main():
        loop = asyncio.get_running_loop()
        transport = TransportWithASlowReceiver()
        swarm = unit_swarm(loop, [member("a", 0), member("b", 0), member("slow", 0)], transport=transport)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        message = OutgoingMessage.from_arrays(PGRAD, 0, {"w": np.zeros(10_000, np.uint8)})
        assert ex.costs().shared_ratio == 0.0  # nothing measured
        await ex.sender._send_all(0, message)
        ex.sender._round_durations, ex.sender._handed_bytes = (2.0,), message.total_bytes
        assert ex.costs().shared_ratio == pytest.approx(3 * (0.3 - 0.01) / 2)  # over a 2 s round
        assert ex.costs().send_ratio == pytest.approx(0.3 / 2)  # our own link: 0.3 s of 2
        transport.uplink_bound = True
        own = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        await own.sender._send_all(0, message)
        own.sender._round_durations, own.sender._handed_bytes = (2.0,), message.total_bytes
        assert own.costs().shared_ratio == pytest.approx(0.0)
    run_virtual(main())


class TransportThatBreaksFirst:
    """Each peer's first push breaks with `first` (then the peer takes what `then` says)."""
    limits = TransferLimits()  # the need-by of a push follows the transport's limits

    def __init__(self, first: Exception, then: Exception | None = None):
        self.first, self.then, self.calls = first, then, []

    async def push(self, peer, message, need_by=None):
        self.calls.append(peer)
        if self.calls.count(peer) == 1:
            raise self.first
        if self.then is not None:
            raise self.then


@pytest.mark.parametrize("first, then, tries, failed", [
    (TransferFailed("the stream to peer a broke"), None, 2, False),    # tried again: delivered
    (TransferFailed("the stream to peer a broke"),                     # it had arrived after all
     RemoteRefused("a", PGRAD, Reason.REPLAYED), 2, False),
    (TransferFailed("could not open a stream"), TransferFailed("again"), 3, True),  # SEND_TRIES
    (TransferTimeout("did not complete within 120 s"), None, 1, True),  # the deadline is spent
    (RemoteRefused("a", PGRAD, Reason.STALE_ROUND), None, 1, True),     # the receiver's answer
])
def test_a_push_that_broke_is_tried_again_within_the_deadline(first, then, tries, failed):
    """At 1.1 Mbit/s 6 of 9 failed pushes had broken (idle, reset, ended, dial), two members
    waited 81-86 s and φ split: a broken push is tried again; a refusal or a spent deadline is
    final."""
    import numpy as np

    async def main():
        loop = asyncio.get_running_loop()
        events: list = []
        transport = TransportThatBreaksFirst(first, then)
        swarm = unit_swarm(loop, [member("a", 0)], transport=transport, events=events)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        message = OutgoingMessage.from_arrays(PGRAD, 0, {"w": np.zeros(100, np.uint8)})
        await ex.sender._send_all(0, message)
        assert len(transport.calls) == tries
        assert any(isinstance(e, SendFailed) for e in events) == failed
    run_virtual(main())


def test_a_round_stretched_by_a_wait_does_not_make_the_link_look_idle():
    """After an 81 s wait on the network the round measured 97 s, the ratio read 0.17 and the
    controller doubled the rank onto the same saturated link: compute is the shortest of the
    last rounds."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), unit_swarm(loop, [member("a", 0)]),
                             random.Random(0))
        ex.sender._link_costs, ex.sender._handed_bytes = (1e-4,), 100_000  # 10 s to send
        ex.sender._round_durations = (16.0, 16.0, 97.0)
        assert ex.costs().send_ratio == pytest.approx(10 / 16)
    run_virtual(main())


def test_a_committee_members_round_is_timed_per_round_not_per_send():
    """A committee member sends every few rounds: one of its rounds is the time between two
    sends over the rounds between them, what the controller's send ratio compares a send with
    (timed per send, a member sending every 4th round read its link 4 times as fast)."""
    import numpy as np
    from types import SimpleNamespace

    from node.rounds.dilocox import sending
    from p2p.messages import OutgoingTensor

    clock = iter([100.0, 112.0])
    swarm = SimpleNamespace(bridge=SimpleNamespace(spawn=lambda *args, **kwargs: None))
    sender = sending.RoundSender(swarm, lambda: [], lambda message: None, clock=lambda: next(clock))
    tensors = [OutgoingTensor("w", "uint8", (4,), np.zeros(4, np.uint8))]
    sender.send_round(2, tensors)
    sender.send_round(6, tensors)
    assert sender.last_round_s == 3.0


class TransportRecordingNeedBys:
    limits = TransferLimits(stall_s=30.0, min_rate_bytes_per_s=125_000.0)

    def __init__(self):
        self.need_bys: list = []

    async def push(self, peer, message, need_by=None):
        self.need_bys.append(need_by)


def test_a_push_may_take_what_all_its_copies_take_over_our_uplink_at_the_swarms_minimum_rate():
    """No fixed cut (message_deadline_s was one): the round's copies share our uplink, so each
    push's need-by is all of them at the swarm's minimum link rate, plus a stall's worth."""
    import numpy as np

    async def main():
        loop = asyncio.get_running_loop()
        transport = TransportRecordingNeedBys()
        swarm = unit_swarm(loop, [member("a", 0), member("b", 0), member("c", 0)], transport=transport)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        message = OutgoingMessage.from_arrays(PGRAD, 0, {"g": np.zeros(1_000_000, np.uint8)})
        await ex.sender._send_all(0, message)
        assert len(transport.need_bys) == 3
        for need_by in transport.need_bys:  # 3 MB at 125 kB/s: 24 s, and 30 s of stall
            assert need_by.seconds == pytest.approx(54.0, abs=0.5)
            assert need_by.why == "the 54 s that 3 copies of it take at the swarm's minimum link rate of 1 Mbit/s"
    run_virtual(main())


def test_a_send_slower_than_the_round_needs_says_in_one_sentence_that_the_link_cannot_carry_it():
    """node/rounds/link_watch.py, fed by the sender: a link of 0.8 Mbit/s (at most: the pushes
    sleep 10 µs a byte) against the tiny preset's low-rank message every 0.2 s round, which
    needs 2.3 Mbit/s; without the controller the protocol cannot send less."""
    import numpy as np

    from node.config.manifest import load_manifest
    from node.rounds.link_watch import LinkWatch

    async def main():
        loop = asyncio.get_running_loop()
        swarm = unit_swarm(loop, [member("a", 0)], transport=TransportAtAFixedRate())
        judged: list = []
        swarm.link_watch = LinkWatch(load_manifest("configs/swarms/local-dilocox.toml"), 256, judged.append)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        message = OutgoingMessage.from_arrays("dilocox.pgrad", 0, {"w": np.zeros(10_000, np.uint8)})
        await ex.sender._send_all(0, message)
        assert judged == []  # no round measured yet
        ex.sender._round_durations = (0.2,)
        await ex.sender._send_all(1, message)
        assert [(e.level, e.round) for e in judged] == [("too_slow", 1)] and judged[0].measured_mbit <= 0.8
        assert judged[0].text.startswith("this node's link, ")
        assert "as its last send to its group measured it, cannot carry the exchange of swarm " \
               "'local-dilocox': a dilocox round of 0.2 s moves 0.1 MB up and 0.1 MB down per node (its " \
               "message, lowrank at rank 8 and 4 bits, to 1 members and 1 members' messages in), which " \
               "needs 2.3 Mbit/s up and 2.3 Mbit/s down; and the protocol as configured cannot send less." \
               in judged[0].text
    run_virtual(main())
