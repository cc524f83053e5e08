"""DiLoCoXExchange's collect on the event loop, without a network: who it waits for, how long,
and where it fetches a message that did not come (tests/dilocox_parts.py builds the swarm)."""

import asyncio
import random
import types

import numpy as np
import pytest

from node.config.manifest import ProtocolSection
from node.events import Missing, Relayed
from node.rounds.contributions import MISBEHAVIOUR
from node.rounds.dilocox import exchange as exchange_module
from node.rounds.dilocox.evidence import Version
from node.rounds.dilocox.exchange import DiLoCoXExchange
from node.rounds.dilocox.link import is_behind
from node.rounds.dilocox.relay import ASK_AFTER_S, AUTHOR, Relay
from node.rounds.dilocox.sending import PGRAD
from p2p.errors import Reason, Refusal
from p2p.identity import NodeIdentity
from p2p.messages import OutgoingMessage
from protocol.committee import sends
from tests.dilocox_parts import HoldingTransport, deliver, exchange, member, relayed_copy
from tests.p2p_helpers import MANIFEST, SWARM, as_received, make_header
from tests.swarm_parts import member as live_member
from tests.swarm_parts import unit_swarm
from tests.virtual_time import run as run_virtual


def test_with_a_committee_a_round_waits_only_for_the_members_drawn_to_send_in_it():
    """15 members and us, about 4 senders a round (protocol/committee.py): every member finished
    round 3, the messages of those drawn for it came, and the round is complete at once; with
    no committee the same round still lacks the others'."""
    async def main():
        loop = asyncio.get_running_loop()
        names = [f"member-{i}" for i in range(15)]

        def exchange_with(senders: int) -> DiLoCoXExchange:
            config = ProtocolSection(name="dilocox", fan_out=32, message_deadline_s=30.0,
                                     senders=senders)
            return DiLoCoXExchange(config, unit_swarm(loop, [member(n, 4) for n in names],
                                                      transport=HoldingTransport({})),
                                   random.Random(0))
        ex, everyone = exchange_with(4), exchange_with(0)
        assert ex._share() == 4 / 16 and everyone._share() == 1.0
        drawn = {n for n in names if sends(n, 3, 4 / 16, ex.tenure)}
        assert 0 < len(drawn) < len(names)
        for n in drawn:
            deliver(ex, 3, n)
            deliver(everyone, 3, n)
        assert ex._complete(3) and not everyone._complete(3)
        began = loop.time()
        assert {g.peer for g in await ex._collect(3, 30.0)} == drawn
        assert loop.time() == began  # complete: no wait at all
    run_virtual(main())


def test_a_member_still_joining_is_sent_nothing():
    """Its exchange is not listening until it has joined: a push to it was refused UNSUPPORTED,
    a refusal on both nodes' status (CI, a swarm of four starting one after another)."""
    async def main():
        loop = asyncio.get_running_loop()
        joining = live_member("joining", 0, "dilocox", "joining")
        ex = exchange(loop, [member("a", 1), joining])
        assert ex.group() == ["a"]
    run_virtual(main())


def test_a_member_still_in_the_round_is_waited_for_at_most_one_of_our_rounds():
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("slow", 3)])  # still training round 3 when we collect it
        ex.last_collect_at = loop.time() - 2.0  # our rounds take 2 s
        loop.call_later(0.3, deliver, ex, 3, "slow")
        began = loop.time()
        got = await ex._collect(3, 30.0)
        assert [g.peer for g in got] == ["slow"] and loop.time() - began == pytest.approx(0.3)
        # the wait was for a member behind us: what a round's end beside training holds it for
        assert ex.ran_ahead_s == pytest.approx(0.3)
        # it stays in round 4: we wait one of our rounds (1 s), not the 30 s deadline
        ex.members.records["slow"] = member("slow", 4)
        await asyncio.sleep(0.7)
        began = loop.time()
        assert await ex._collect(4, 30.0) == []
        assert loop.time() - began == pytest.approx(1.0) == ex.ran_ahead_s
    run_virtual(main())


def test_a_member_whose_record_lags_is_waited_for_by_the_round_its_last_message_shows():
    """Its record (through the DHT) still says round 3, but its message of round 4 came: it
    trains round 5 now, and collecting round 5 waits for it as for any member in the round.
    (A node on a 512 kbit/s link, its records rounds stale, waited for no one and refused every
    member's message as stale.)"""
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("lagging view", 3)])
        ex.heard["lagging view"] = 4  # as _on_message records it
        ex.last_collect_at = loop.time() - 2.0
        loop.call_later(0.3, deliver, ex, 5, "lagging view")
        got = await ex._collect(5, 30.0)
        assert [g.peer for g in got] == ["lagging view"]
        assert ex._finished(4) == {"lagging view"} and ex._in_round(5) == {"lagging view"}
    run_virtual(main())


def test_a_member_whose_message_is_arriving_is_waited_for_as_one_that_finished():
    """Its record says it still trains the round (we would wait one of our rounds, 0.5 s), but
    its push of the round is coming in: it finished, and the push is waited for up to the
    deadline (over 512 kbit/s three such pushes took 19 s; cut off, φ split for good)."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("slow link", 5)])
        ex.transport.arriving.add(("slow link", 5))
        ex.last_collect_at = loop.time() - 0.5
        loop.call_later(1.5, deliver, ex, 5, "slow link")
        got = await ex._collect(5, 30.0)
        assert [g.peer for g in got] == ["slow link"]
    run_virtual(main())


def test_a_push_of_a_message_a_member_already_handed_on_is_refused_unread_and_strikes_no_one():
    async def main():
        loop = asyncio.get_running_loop()
        author = NodeIdentity.generate()
        name = author.peer_id.to_base58()
        ex = exchange(loop, [member(name, 6)])
        ex.first_round = 5  # we train round 5 too
        deliver(ex, 5, name)  # a relayed copy came first
        with pytest.raises(Refusal) as refused:
            ex._check_head(make_header(author, b"me", kind=PGRAD, round=5))
        assert refused.value.reason is Reason.HELD and "HELD" not in MISBEHAVIOUR
        ex._check_head(make_header(author, b"me", kind=PGRAD, round=6))  # not held: read it
    run_virtual(main())


def test_a_node_is_behind_once_a_majority_finished_the_round_after_its_own():
    """Members that announce round r + 2 have ended round r + 1 and collect our message of r
    now: a node still training r is behind. One member far ahead (or lying) is not a majority;
    a majority further ahead is the catch-up's (the state, not rounds ended one by one)."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("a", 5), member("b", 5), member("c", 4)])
        ex._refresh_swarm_round()
        assert is_behind(3, ex.swarm_round) and not is_behind(4, ex.swarm_round)
        assert not is_behind(2, ex.swarm_round)
        ex = exchange(loop, [member("far", 90), member("b", 4), member("c", 4)])
        ex._refresh_swarm_round()
        assert not is_behind(3, ex.swarm_round)
    run_virtual(main())


def test_a_finished_members_message_is_waited_for_a_round_then_only_while_on_its_way(monkeypatch):
    """A member that finished the round and whose message has not come is waited for one of our
    rounds (at least ASKING_S), its message asked of the others meanwhile; beyond that only
    while its message is on its way to us. (R5: a slow node sent its message of a round to no
    one, and each fast node waited the whole 120 s deadline for it.)"""
    monkeypatch.setattr(exchange_module, "ASKING_S", 1.5)
    monkeypatch.setattr(exchange_module, "ON_ITS_WAY_S", 1.5)

    async def main():
        loop = asyncio.get_running_loop()
        events: list = []
        swarm = unit_swarm(loop, [member("done", 6)], transport=HoldingTransport({}), events=events)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=8, message_deadline_s=30.0),
                             swarm, random.Random(0))  # announced round 6: it sent its round-5 message
        ex.last_collect_at = loop.time() - 2.0  # our rounds take 2 s
        began = loop.time()
        assert await ex._collect(5, 30.0) == []
        assert loop.time() - began == pytest.approx(2.0)  # one of our rounds
        assert ex.ran_ahead_s == 0.0  # it is not behind us: we are not ahead of it
        assert [e.peers for e in events if isinstance(e, Missing)] == [["done"]]
        # a push of it still coming in at the round's end is waited for past it
        ex = exchange(loop, [member("done", 6)])
        ex.last_collect_at = loop.time() - 0.5
        ex.transport.arriving.add(("done", 5))
        loop.call_later(2.2, deliver, ex, 5, "done")
        began = loop.time()
        assert [g.peer for g in await ex._collect(5, 30.0)] == ["done"]
        assert loop.time() - began == pytest.approx(2.2)  # when it came
        # a member two rounds behind is a straggler: nobody waits on it
        ex = exchange(loop, [member("behind", 3)])
        ex.last_collect_at = loop.time() - 5.0
        began = loop.time()
        assert await ex._collect(5, 30.0) == [] and loop.time() == began
    run_virtual(main())


class SlowHolder(HoldingTransport):
    """Serves its copies after `serve_s`: a holder on a slow link."""

    def __init__(self, copies: dict, serve_s: float):
        super().__init__(copies)
        self.serve_s = serve_s

    async def request(self, peer, kind, round_index, *, meta, streams, need_by=None, expected_reply_bytes=0):
        await asyncio.sleep(self.serve_s)
        return await super().request(peer, kind, round_index, meta=meta, need_by=need_by, streams=streams)


def test_a_copy_being_fetched_at_the_rounds_end_is_waited_for(monkeypatch):
    monkeypatch.setattr(exchange_module, "ASKING_S", 1.5)
    monkeypatch.setattr(exchange_module, "ON_ITS_WAY_S", 1.5)

    async def main():
        loop = asyncio.get_running_loop()
        author, holder = NodeIdentity.generate(), NodeIdentity.generate()
        a, h = author.peer_id.to_base58(), holder.peer_id.to_base58()
        transport = SlowHolder({(h, 5, a): relayed_copy(author, holder, 5)}, serve_s=2.0)
        swarm = unit_swarm(loop, [member(a, 6), member(h, 6)], transport=transport)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=1, message_deadline_s=30.0),
                             swarm, random.Random(0))
        ex.last_collect_at = loop.time() - 0.5
        deliver(ex, 5, h)
        began = loop.time()
        got = await ex._collect(5, 30.0)  # asked at 0.5 s, served at 2.5 s: past the 1.5 s wait
        assert sorted(g.peer for g in got) == sorted([a, h])
        assert loop.time() - began == pytest.approx(ASK_AFTER_S + 2.0)
    run_virtual(main())


def test_a_node_ahead_of_a_majority_waits_for_them_one_of_its_rounds():
    """Three members two rounds behind and one in step: we are the one ahead, and a collect
    waits for them as for members still in the round (one of our rounds), so that our pace
    slows to theirs. (A node on a slow link that started first never waited, refused their
    every message as stale and applied its own alone for 18 rounds.)"""
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("a", 3), member("b", 3), member("d", 3), member("c", 6)])
        ex.last_collect_at = loop.time() - 0.5
        deliver(ex, 5, "c")
        began = loop.time()
        assert [g.peer for g in await ex._collect(5, 30.0)] == ["c"]
        assert loop.time() - began == pytest.approx(0.5) == ex.ran_ahead_s  # one of our rounds
        # with two of three in step, the one behind is a straggler again: not waited for
        ex = exchange(loop, [member("a", 3), member("b", 6), member("c", 6)])
        ex.last_collect_at = loop.time() - 0.5
        deliver(ex, 5, "b")
        deliver(ex, 5, "c")
        began = loop.time()
        assert [g.peer for g in await ex._collect(5, 30.0)] == ["b", "c"]
        assert loop.time() == began
    run_virtual(main())


def test_a_round_is_not_complete_while_the_majority_behind_it_has_not_sent():
    """apply_on_arrival takes a round's step early once the round is complete. Members a round
    behind, when they are the majority, are waited for at the round's end (`_unfinished`); so
    the round is not complete without their messages either: otherwise a node ahead of all its
    members took every step alone and ran ahead, never waiting (the 512 kbit/s slow node)."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("b", 4), member("c", 4)])  # both still train round 4
        assert not ex._complete(5) and await ex._take_if_complete(5) is None
        deliver(ex, 5, "b")
        assert not ex._complete(5)
        deliver(ex, 5, "c")
        assert ex._complete(5)
        ex2 = exchange(loop, [member("b", 4), member("c", 6), member("d", 6)])  # one straggler
        deliver(ex2, 5, "c")
        deliver(ex2, 5, "d")
        assert ex2._complete(5)  # a minority behind is not waited for
    run_virtual(main())


def test_a_late_joiner_waits_for_its_first_round_only_one_of_its_own_rounds():
    """Members may have ended the round we joined in (or the swarm's first) before they saw us,
    and never send us its message: we must not wait the whole deadline for them (a joiner
    stalled 120 s in CI)."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("ahead", 8)])  # finished round 7 and moved on
        ex.first_round = 7  # we joined late, in round 7
        assert await ex._collect(6, 30.0) == []  # the round before: not waited for at all
        ex.last_collect_at = loop.time() - 0.5  # our rounds take 0.5 s
        began = loop.time()
        assert await ex._collect(7, 30.0) == []
        assert loop.time() - began == pytest.approx(0.5)
        # from the next round on, a member that finished the round is waited for as usual
        ex.inbox.clear()
        ex.last_collect_at = loop.time() - 0.5
        ex.members.records["ahead"] = member("ahead", 9)
        began = loop.time()
        assert await ex._collect(8, 1.5) == []
        assert loop.time() - began == pytest.approx(1.5)  # the deadline
        # the swarm's first round likewise: a member may have sent its round-0 message before
        # its view listed us (CI: 9.4 s waited, 7 rounds behind); at the first collect "one of
        # our rounds" is the last round's length
        ex = exchange(loop, [member("first", 1)])
        ex.sender._round_durations = (0.5,)
        began = loop.time()
        assert await ex._collect(0, 30.0) == []
        assert loop.time() - began == pytest.approx(0.5)
    run_virtual(main())


def test_beyond_the_fan_out_a_finished_members_message_is_fetched_from_a_member_holding_it():
    """Each member sends to a random subset of fan_out peers: one that finished may never send
    to us. Its message is asked of the others (relay.py) and applied like any: every member
    applies the same messages, where they split φ every round before."""
    async def main():
        loop = asyncio.get_running_loop()
        author, holder = NodeIdentity.generate(), NodeIdentity.generate()
        a, h = author.peer_id.to_base58(), holder.peer_id.to_base58()
        transport = HoldingTransport({(h, 5, a): relayed_copy(author, holder, 5)})
        events: list = []
        swarm = unit_swarm(loop, [member(a, 6), member(h, 6)], transport=transport, events=events)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=1, message_deadline_s=30.0),
                             swarm, random.Random(0))
        ex.last_collect_at = loop.time() - 0.5
        deliver(ex, 5, h)  # the holder's own message came; the author sent us nothing
        began = loop.time()
        got = await ex._collect(5, 30.0)
        assert sorted(g.peer for g in got) == sorted([a, h])
        assert loop.time() - began == pytest.approx(ASK_AFTER_S)  # asked, served at once
        assert [(e.author, e.holder) for e in events if isinstance(e, Relayed)] == [(a, h)]
        assert ex.relay.store.get(5, a) is not None  # ours to hand on in turn
    run_virtual(main())


def test_a_relay_serving_a_copy_its_author_did_not_sign_is_banned_and_another_is_asked():
    async def main():
        loop = asyncio.get_running_loop()
        author, liar, honest = (NodeIdentity.generate() for _ in range(3))
        a, bad, good = (i.peer_id.to_base58() for i in (author, liar, honest))
        transport = HoldingTransport({(bad, 5, a): relayed_copy(author, liar, 5, tamper=True),
                                      (good, 5, a): relayed_copy(author, honest, 5)})
        # the liar finished the round and is asked first; the honest member still trains it
        swarm = unit_swarm(loop, [member(a, 6), member(bad, 6), member(good, 5)],
                           transport=transport)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=8, message_deadline_s=30.0),
                             swarm, random.Random(0))
        ex.last_collect_at = loop.time() - 10.0
        deliver(ex, 5, bad)
        deliver(ex, 5, good)
        got = {g.peer: g.message for g in await ex._collect(5, 30.0)}
        assert transport.asked == [bad, good] and transport.banned == [bad]
        assert swarm.bans.is_banned(bad) and got[a].payload[0] == 0
    run_virtual(main())


def test_an_author_serves_its_own_signed_message_and_is_asked_for_it_after_the_members():
    """A message no member holds (its push to them broke, or went to others beyond the fan-out)
    is still had from its author, which keeps its own as it signed it (relay.py `keep_own`);
    the author is asked last, so that members holding a copy carry the asking."""
    async def main():
        loop = asyncio.get_running_loop()
        author, holder = NodeIdentity.generate(), NodeIdentity.generate()
        a, h = author.peer_id.to_base58(), holder.peer_id.to_base58()
        authors = Relay(unit_swarm(loop, peer_id=a, transport=types.SimpleNamespace(
            identity=author, swarm=SWARM, manifest=MANIFEST)), PGRAD, lambda *_: True, loop.time)
        own = OutgoingMessage.from_arrays(PGRAD, 5, {"c": np.arange(16, dtype=np.uint8)})
        authors.sign(own)
        authors.keep_own(own)
        served = await authors._respond(types.SimpleNamespace(round=5, meta={AUTHOR: a}))
        transport = HoldingTransport({(a, 5, a): as_received(served, delivered_by=author)})
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=8, message_deadline_s=30.0),
                             unit_swarm(loop, [member(a, 6), member(h, 6)], transport=transport),
                             random.Random(0))
        ex.last_collect_at = loop.time() - 0.5
        deliver(ex, 5, h)  # the holder's own message came; it holds no copy of the author's
        got = await ex._collect(5, 30.0)
        assert sorted(g.peer for g in got) == sorted([a, h]) and transport.asked == [h, a]
    run_virtual(main())


def test_an_author_a_member_reported_holding_the_signed_message_of_is_finished():
    """Its record still says it trains round 5 (records lag), but a member reported holding its
    signed message of round 5 (evidence.py SEEN): it finished, and the message is fetched from
    that member, not waited for one of our rounds and then given up (φ split)."""
    async def main():
        loop = asyncio.get_running_loop()
        author, holder = NodeIdentity.generate(), NodeIdentity.generate()
        a, h = author.peer_id.to_base58(), holder.peer_id.to_base58()
        copy = relayed_copy(author, holder, 5)
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=8, message_deadline_s=30.0),
                             unit_swarm(loop, [member(a, 5), member(h, 6)],
                                        transport=HoldingTransport({(h, 5, a): copy})),
                             random.Random(0))
        ex.last_collect_at = loop.time() - 0.5
        deliver(ex, 5, h)
        ex.evidence._see(Version.of(a, 5, copy.meta))  # as h's report of what it accepted
        got = await ex._collect(5, 30.0)
        assert sorted(g.peer for g in got) == sorted([a, h])
    run_virtual(main())
