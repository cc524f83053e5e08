"""NoLoCoExchange's answer to a partner's swap, on the event loop, without a network, on
virtual time (tests/virtual_time.py): a wait is read exactly, however loaded the machine.

A pair's initiator opens the swap as soon as it accepts; its accept travels on another stream,
so the swap can reach the proposer first. The proposer must hold the swap until its proposal is
answered, not refuse it (refusing left both nodes waiting the whole pair deadline).
"""

import asyncio
import random
from types import SimpleNamespace

import pytest

from node.config.manifest import ProtocolSection
from node.rounds.noloco.exchange import NoLoCoExchange
from p2p.errors import Reason, Refusal, RemoteRefused
from p2p.messages import OutgoingMessage
from protocol.matching import MatchMessage, MessageKind, ReadyAnnouncement
from tests.swarm_parts import member, unit_swarm
from tests.virtual_time import run_virtual

ME, PEER, STRANGER = "zz-me", "aa-peer", "bb-stranger"  # PEER's id is lower: it initiates
HIGHER = "zzz-peer"  # a higher id than ours: we initiate
BLOCKING = ProtocolSection(timing="blocking", pair_deadline_s=30.0)


def blocking_exchange(loop, transport=None, events=None) -> NoLoCoExchange:
    ex = NoLoCoExchange(BLOCKING, unit_swarm(loop, peer_id=ME, transport=transport, events=events),
                        random.Random(0))
    ex.offered, ex.accepting = OutgoingMessage("noloco.snapshot", 0), True
    return ex


def propose_to_peer(ex: NoLoCoExchange) -> None:
    proposal = ex.matching.choose_candidate([ReadyAnnouncement(PEER, "m", 0)], random.Random(0))
    assert proposal is not None and proposal.recipient == PEER


def swap_from(peer: str):
    return SimpleNamespace(sender=peer)  # the header fields _snapshot_reply reads


def proposed_and_answered_soon(loop, answer: MessageKind) -> NoLoCoExchange:
    """An exchange that proposed to PEER, whose `answer` lands 50 ms from now."""
    ex = blocking_exchange(loop)
    propose_to_peer(ex)
    loop.call_later(0.05, ex._handle, MatchMessage(answer, PEER, ME, 0, 0, "m"))
    return ex


def test_a_swap_that_overtakes_the_accept_is_served_once_the_accept_lands():
    async def main():
        loop = asyncio.get_running_loop()
        ex = proposed_and_answered_soon(loop, MessageKind.ACCEPT)
        began = loop.time()
        reply = await ex._snapshot_reply(swap_from(PEER))
        assert reply is ex.offered and loop.time() - began == pytest.approx(0.05)  # the accept's
        assert ex.matching.pair is not None and ex.matching.pair.partner == PEER
    run_virtual(main())


def test_a_swap_from_a_peer_that_declines_is_refused_without_waiting_the_timeout():
    async def main():
        loop = asyncio.get_running_loop()
        ex = proposed_and_answered_soon(loop, MessageKind.DECLINE)
        began = loop.time()
        with pytest.raises(Refusal, match="not paired"):
            await ex._snapshot_reply(swap_from(PEER))
        assert loop.time() - began == pytest.approx(0.05)  # the decline's arrival, not a timeout
        assert ex._settling == []
    run_virtual(main())


def test_a_swap_from_a_peer_we_never_proposed_to_is_refused_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        ex = blocking_exchange(loop)
        propose_to_peer(ex)
        began = loop.time()
        with pytest.raises(Refusal, match="not paired"):
            await ex._snapshot_reply(swap_from(STRANGER))
        assert loop.time() - began == 0
    run_virtual(main())


class RefusingTransport:
    """Answers every swap as a peer that holds no pair with us would (the real refusal's type)."""

    def __init__(self):
        self.pushed: list = []

    async def swap(self, peer, message, need_by, expected_reply_bytes, accept_bytes=None):
        raise RemoteRefused(peer, "noloco.snapshot", Reason.NOT_PAIRED, "not paired with you")

    async def push(self, peer, message, need_by=None):
        self.pushed.append((peer, message.meta["k"]))


async def wait_until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


class Kinds(list):
    """The kinds of the events published, in order."""

    def append(self, event) -> None:
        super().append(event.kind)


def exchange_with_events(loop, transport=None):
    events = Kinds()
    return blocking_exchange(loop, transport, events), events


def test_a_cancel_from_the_proposer_drops_our_pair_and_we_look_again():
    async def main():
        loop = asyncio.get_running_loop()
        ex, events = exchange_with_events(loop, RefusingTransport())
        ex._handle(MatchMessage(MessageKind.PROPOSE, STRANGER, ME, 0, 0, "m"))  # we accept
        assert ex.matching.pair.partner == STRANGER and events == ["paired"]
        ex._handle(MatchMessage(MessageKind.CANCEL, STRANGER, ME, 0, 1, "m"))
        assert ex.matching.pair is None and ex.matching.wants_partner
        assert events == ["paired", "pair_cancelled"] and ex.failed_round is None
    run_virtual(main())


def test_a_swap_refused_as_not_paired_drops_the_pair_without_a_failure():
    async def main():
        loop = asyncio.get_running_loop()
        ex, events = exchange_with_events(loop, RefusingTransport())
        # we accept a higher id's proposal, so we open the swap at once; the peer refuses it
        ex._handle(MatchMessage(MessageKind.PROPOSE, HIGHER, ME, 0, 0, "m"))
        assert ex.matching.pair.initiator == ME
        await asyncio.wait_for(wait_until(lambda: ex.matching.pair is None), 2.0)
        assert ex.matching.wants_partner
        assert events == ["paired", "pair_cancelled"]
        assert ex.failed_round is None  # blocking keeps waiting
    run_virtual(main())


def test_a_snapshot_delivered_after_our_round_ended_is_counted_late_not_dropped_unseen():
    """Soak: a pair formed 15 ms before the acceptor's round ended; the initiator's snapshot
    landed in the next round and vanished without an event."""
    async def main():
        loop = asyncio.get_running_loop()
        ex, events = exchange_with_events(loop)
        ex._handle(MatchMessage(MessageKind.PROPOSE, PEER, ME, 0, 0, "m"))  # PEER initiates
        ex._next_round(1)
        await ex._snapshot_delivered(SimpleNamespace(sender=PEER, round=0))
        assert events == ["paired", "swap_late"] and ex.partners == {}
    run_virtual(main())


def test_a_snapshot_that_overtakes_the_accept_is_stored_once_the_accept_lands():
    """CI: the initiator's 122 kB snapshot was delivered 5 ms before its accept, found no pair,
    was dropped while the initiator was told OK, and our round waited its 60 s deadline."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = proposed_and_answered_soon(loop, MessageKind.ACCEPT)
        began = loop.time()
        await ex._snapshot_delivered(SimpleNamespace(sender=PEER, round=0, payload=b"theta"))
        assert loop.time() - began == pytest.approx(0.05)  # stored when the accept landed
        assert [p.peer for p in ex.partners.values()] == [PEER] and ex.landed.is_set()
    run_virtual(main())


def test_a_snapshot_that_overtakes_the_accept_waits_for_it_after_an_earlier_pair_with_that_peer():
    """CI: two nodes paired in rounds 0 and 1; round 2's snapshot overtook its accept, found the
    closed pair of round 1 with the same peer, was dropped, and our round waited 60 s."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = blocking_exchange(loop)
        propose_to_peer(ex)
        ex._handle(MatchMessage(MessageKind.ACCEPT, PEER, ME, 0, 0, "m"))
        await ex._snapshot_delivered(SimpleNamespace(sender=PEER, round=0, payload=b"theta"))
        assert set(ex.partners) == {0}
        ex._next_round(1)
        ex.accepting = True  # blocking: ready again at the end of round 1
        proposal = ex.matching.choose_candidate([ReadyAnnouncement(PEER, "m", 1)], random.Random(0))
        assert proposal is not None and proposal.recipient == PEER
        loop.call_later(0.05, ex._handle, MatchMessage(MessageKind.ACCEPT, PEER, ME, 1, 1, "m"))
        await ex._snapshot_delivered(SimpleNamespace(sender=PEER, round=1, payload=b"theta"))
        assert 1 in ex.partners and ex.partners[1].pair_round == 1, ex.partners
    run_virtual(main())


def overlap_exchange(loop, max_swap_rounds: int = 2):
    events = Kinds()
    section = ProtocolSection(timing="overlap", max_swap_rounds=max_swap_rounds)
    swarm = unit_swarm(loop, peer_id=ME, transport=RefusingTransport(), events=events)
    ex = NoLoCoExchange(section, swarm, random.Random(0))
    ex.offered = OutgoingMessage("noloco.snapshot", 0)
    return ex, events


def test_overlap_keeps_a_snapshot_landing_rounds_after_its_pair_and_drops_an_older_one():
    """A swap may outlast its round: its snapshot is kept for the round to apply, up to
    max_swap_rounds rounds after the pair's round; later it is counted late."""
    async def main():
        loop = asyncio.get_running_loop()
        ex, events = overlap_exchange(loop, max_swap_rounds=2)
        ex._handle(MatchMessage(MessageKind.PROPOSE, PEER, ME, 0, 0, "m"))  # PEER initiates
        ex._next_round(1)
        ex._next_round(2)
        await ex._snapshot_delivered(SimpleNamespace(sender=PEER, round=0, payload=b"theta"))
        assert events[-1] == "swapped" and ex.partners[0].pair_round == 0 and ex.landed.is_set()
        ex._handle(MatchMessage(MessageKind.PROPOSE, STRANGER, ME, 2, 2, "m"))
        for r in (3, 4, 5):
            ex._next_round(r)
        await ex._snapshot_delivered(SimpleNamespace(sender=STRANGER, round=2, payload=b"theta"))
        assert events[-1] == "swap_late" and set(ex.partners) == set()  # round 0's aged out too
    run_virtual(main())


def test_a_node_ahead_of_its_swarm_goes_back_to_its_round_once_no_pair_is_in_flight():
    """Two members at round 10, this node ending round 14: eligible for nobody (max_staleness
    2), it goes back to round 10, but not while a pair of a round it would leave is open (that
    pair's snapshot would land keyed by a round still to come)."""
    async def main():
        loop = asyncio.get_running_loop()
        swarm = unit_swarm(loop, [member(PEER, 10), member(STRANGER, 10)], peer_id=ME,
                           transport=RefusingTransport())
        ex = NoLoCoExchange(ProtocolSection(timing="overlap"), swarm, random.Random(0))
        ex.offered = OutgoingMessage("noloco.snapshot", 14)
        ex._next_round(14)
        ahead = "ac-ahead"  # another node at our round, with a lower id: it opens the swap
        ex._handle(MatchMessage(MessageKind.PROPOSE, ahead, ME, 14, 14, "m"))
        assert ex.open_pairs
        assert await loop.run_in_executor(None, ex.catch_up_round, 14) is None
        ex._swap_ended(ahead, 14)
        assert not ex.open_pairs
        assert await loop.run_in_executor(None, ex.catch_up_round, 14) == 10
        assert await loop.run_in_executor(None, ex.catch_up_round, 11) is None  # within 2
        await ex.stop()
    run_virtual(main())


def test_a_member_claiming_a_round_no_one_could_have_reached_does_not_move_the_node(caplog):
    """The swarm's round with one peer in view is that peer's: a liar claiming round 10^6 moved
    an honest node there in CI, its step schedule over at once. A member's round counts only up
    to `round_bound` of the rounds this node could have trained since it started (its waiting
    for peers included: they train meanwhile), and the claim is logged once."""
    async def main():
        loop = asyncio.get_running_loop()
        liar = member(STRANGER, 10**6)
        swarm = unit_swarm(loop, [liar], peer_id=ME)
        ex = NoLoCoExchange(ProtocolSection(timing="overlap"), swarm, random.Random(0))
        ex.started_at -= 10.0  # it waited 9 s for peers (since it was built at round 0)...
        ex._round_started -= 1.0  # ...then trained a round of 1 s
        for _ in range(2):
            assert await loop.run_in_executor(None, ex.catch_up_round, 0) is None
        said = [r.getMessage() for r in caplog.records if "claims round 1000000" in r.message]
        assert len(said) == 1 and STRANGER in said[0] and "(at most 5" in said[0], said  # 16 + 4 x 10 s / 1 s
        swarm.members.records[PEER] = member(PEER, 30)  # 30 rounds in 10 s: possible, honest
        assert await loop.run_in_executor(None, ex.catch_up_round, 0) == 30
    run_virtual(main())


def test_a_node_whose_swaps_outlast_its_rounds_rests_then_pairs_again():
    async def main():
        loop = asyncio.get_running_loop()
        ex, events = overlap_exchange(loop, max_swap_rounds=4)
        ex.pacer.record_swap(25.0)
        ex.pacer.paired(0)

        def next_round(r):  # after a 10 s round: swaps take 2.5 rounds
            ex._round_started = loop.time() - 10.0
            ex._next_round(r)
        next_round(1)
        assert ex.pacer.interval == 3 and not ex.accepting
        assert events[-2:] == ["pairing_paced", "rested"]
        await asyncio.sleep(0)  # the member record's update runs as a task
        assert ex.membership.membership.updates[-1]["status"] == "training"  # nobody proposes
        next_round(2)
        assert not ex.accepting and events[-1] == "rested"
        next_round(3)  # three rounds after it last paired: it pairs again
        assert ex.accepting and events.count("rested") == 2
    run_virtual(main())


class BrokenTransport(RefusingTransport):
    """A swap that fails with an error that is not the network's (an encoding bug, a bound the
    send planner enforces): it escaped `except P2PError` and vanished as a failed task."""

    async def swap(self, peer, message, need_by, expected_reply_bytes, accept_bytes=None):
        raise ValueError("the send planner failed")


def test_a_swap_failing_with_any_error_is_a_counted_swap_failure():
    async def main():
        loop = asyncio.get_running_loop()
        events: list = []
        ex = blocking_exchange(loop, BrokenTransport(), events)
        ex._handle(MatchMessage(MessageKind.PROPOSE, HIGHER, ME, 0, 0, "m"))  # we open the swap
        await asyncio.wait_for(wait_until(lambda: ex.failed_round == 0), 2.0)
        failed = [e for e in events if e.kind == "swap_failed"]
        assert [e.error for e in failed] == ["ValueError: the send planner failed"]
        assert failed[0].logged and not [e for e in events if e.kind == "task_failed"]
        assert ex.open_pairs == {}  # the pacer measured it; nothing waits on it
    run_virtual(main())


class SlowTransport(RefusingTransport):
    """A swap that keeps going until the test lets it land (a slow link, bytes moving)."""

    def __init__(self):
        super().__init__()
        self.started, self.land = asyncio.Event(), asyncio.Event()
        self.need_by = "unset"

    async def swap(self, peer, message, need_by, expected_reply_bytes, accept_bytes=None):
        self.need_by = need_by
        self.started.set()
        await self.land.wait()
        return SimpleNamespace(round=0, payload=b"theirs")


def test_blocking_waits_for_a_swap_under_way_past_the_partner_wait():
    """pair_deadline_s bounds the wait for a partner, not a swap in progress: the transport
    ends a swap that stalls or cannot finish in time (p2p/progress.py), never the clock."""
    async def main():
        loop = asyncio.get_running_loop()
        events = Kinds()
        transport = SlowTransport()
        ex = blocking_exchange(loop, transport, events)
        ex._handle(MatchMessage(MessageKind.PROPOSE, HIGHER, ME, 0, 0, "m"))  # we open the swap
        await asyncio.wait_for(transport.started.wait(), 2.0)
        assert transport.need_by is None  # blocking: the transport's own need-by (its bytes)
        finishing = asyncio.create_task(ex._finish_round(0, [], 0.05, 1))
        await asyncio.sleep(2 * BLOCKING.pair_deadline_s)  # past the pair deadline: still under way
        assert not finishing.done() and "no_partner" not in events
        transport.land.set()
        partner = await asyncio.wait_for(finishing, 2.0)
        assert partner is not None and partner.peer == HIGHER and "swapped" in events
    run_virtual(main())
    run_virtual(main())


def test_overlap_gives_a_swap_the_rounds_it_may_outlast_its_own_by():
    async def main():
        loop = asyncio.get_running_loop()
        ex = NoLoCoExchange(ProtocolSection(timing="overlap", max_swap_rounds=3),
                            unit_swarm(loop, peer_id=ME), random.Random(0))
        assert ex._swap_need_by(0) is None  # no round measured yet: the transport's default
        ex.pacer.round_seconds.extend([10.0, 20.0])
        ex._round_started = loop.time() - 5.0  # 5 s into round 0
        need_by = ex._swap_need_by(0)
        assert need_by.seconds == pytest.approx(4 * 20.0 - 5.0, abs=0.5)  # to the end of round 3
        assert need_by.words.startswith("the 3 rounds it may outlast its own by (75 s")
    run_virtual(main())


def test_a_node_whose_swaps_outlast_its_rounds_says_once_that_its_link_is_too_slow_for_the_swarm():
    """node/rounds/link_watch.py, fed by the pacer's measurements: the tiny preset's int4
    snapshot (1.05 MB) swapped in 25 s, 0.34 Mbit/s, against 10 s rounds that need 0.84 Mbit/s:
    one sentence when the verdict changes (the node pairs less often), none while it holds,
    and one when the swaps fit again."""
    import numpy as np

    from node.config.manifest import load_manifest
    from node.rounds.link_watch import LinkWatch
    from node.rounds.traffic import round_traffic

    async def main():
        loop = asyncio.get_running_loop()
        ex, _ = overlap_exchange(loop, max_swap_rounds=4)
        manifest = load_manifest("configs/swarms/local.toml", {"protocol": {"wire_dtype": "int4"}})
        judged: list = []
        ex.swarm.link_watch = LinkWatch(manifest, 256, judged.append)
        snapshot = round_traffic(manifest, 256).message_bytes
        ex.offered = OutgoingMessage.from_arrays("noloco.snapshot", 0, {"t": np.zeros(snapshot, np.uint8)})

        def next_round(r, swap_s):  # after a 10 s round
            ex.pacer.record_swap(swap_s)
            ex._round_started = loop.time() - 10.0
            ex._next_round(r)
        next_round(1, 25.0)
        assert [(e.kind, e.level, e.round) for e in judged] == [("link_judged", "slower", 1)]
        assert judged[0].text.startswith("this node's link, 0.3 Mbit/s as its last swaps measured it, is "
                                         "too slow for swarm 'local' as configured, so this node will save "
                                         "bytes: a noloco round of 10.0 s moves 1.1 MB up and 1.1 MB down")
        assert judged[0].text.endswith("; pairing once every 4 rounds, the least the protocol allows, "
                                       "needs 0.2 Mbit/s up and 0.2 Mbit/s down.")
        assert judged[0].logged and ex.pacer.interval == 3
        next_round(2, 25.0)
        assert len(judged) == 1  # said once while it holds
        for r in (3, 4, 5):
            next_round(r, 1.0)  # then the median of the last five swaps is 1 s
        assert [e.level for e in judged] == ["slower", "ok"]
    run_virtual(main())
