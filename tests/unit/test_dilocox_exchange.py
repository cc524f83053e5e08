"""DiLoCoXExchange's collect on the event loop, without a network: who it waits for, and how long.

The member view is a plain list of records (what the DHT cache would hold); messages are put in
the inbox as the transport's handler would after its checks.
"""

import asyncio
import dataclasses
import random
import types

import numpy as np
import pytest

from node.config.manifest import ProtocolSection
from node.config.settings import NodeTimeouts
from node.events import Diverged, Missing, Relayed, ReplayReady, SendFailed
from node.rounds.contributions import MISBEHAVIOUR
from node.rounds.dilocox import exchange as exchange_module
from node.rounds.dilocox.exchange import DiLoCoXExchange
from node.rounds.dilocox.link import REPLAY_ROUNDS, SwarmState
from node.rounds.dilocox.relay import ASK_AFTER_S, AUTHOR, RELAY
from node.rounds.dilocox.replay import APPLIED, StepReplay
from node.rounds.dilocox.sending import LINK_MEMORY, PGRAD
from node.rounds.state import STATE_KIND
from p2p.errors import P2PError, Reason, Refusal, RemoteRefused, TransferFailed, TransferTimeout
from p2p.identity import NodeIdentity
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.origin import ORIGIN, sign_origin
from p2p.records import MemberRecord
from protocol.vote import split_winner
from protocol.committee import sends
from tests.p2p_helpers import MANIFEST, SWARM, as_received, make_header
from tests.swarm_parts import member as live_member
from tests.swarm_parts import unit_swarm


def member(peer_id: str, round_index: int) -> MemberRecord:
    return live_member(peer_id, round_index, "dilocox", "training", since=0)


class HoldingTransport:
    """Members holding copies of messages, served as node/rounds/dilocox/relay.py serves them;
    nothing arrives by push. `copies`: (holder, round, author) -> the copy it serves."""

    swarm, manifest = SWARM, MANIFEST

    class limits:
        parallel_streams = 1

    def __init__(self, copies: dict):
        self.copies, self.asked, self.banned = copies, [], []
        self.arriving: set[tuple[str, int]] = set()  # (peer, round): a push of it is coming in

    def receiving(self, peer, kind, round_index) -> bool:
        return (peer, round_index) in self.arriving

    def ban(self, peer, seconds) -> None:
        self.banned.append(peer)

    async def request(self, peer, kind, round_index, *, meta, timeout, streams):
        assert kind == RELAY
        self.asked.append(peer)
        copy = self.copies.get((peer, round_index, meta[AUTHOR]))
        if copy is None:
            raise RemoteRefused(peer, kind, Reason.REFUSED, "no message of that author here")
        return copy


def exchange(loop, records: list[MemberRecord]) -> DiLoCoXExchange:
    """Members hold no copies of what did not come: an ask for one is refused."""
    return DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=8, message_deadline_s=30.0),
                           unit_swarm(loop, records, transport=HoldingTransport({})),
                           random.Random(0))


def deliver(ex: DiLoCoXExchange, round_index: int, peer: str) -> None:
    ex.inbox.setdefault(round_index, {})[peer] = f"message of {peer}"
    ex.arrived.set()


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
        assert loop.time() - began < 0.5
    asyncio.run(main())


def test_a_member_still_joining_is_sent_nothing():
    """Its exchange is not listening until it has joined: a push to it was refused UNSUPPORTED,
    a refusal on both nodes' status (CI, a swarm of four starting one after another)."""
    async def main():
        loop = asyncio.get_running_loop()
        joining = live_member("joining", 0, "dilocox", "joining")
        ex = exchange(loop, [member("a", 1), joining])
        assert ex.group() == ["a"]
    asyncio.run(main())


def test_a_member_still_in_the_round_is_waited_for_at_most_one_of_our_rounds():
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("slow", 3)])  # still training round 3 when we collect it
        ex.last_collect_at = loop.time() - 2.0  # our rounds take 2 s
        loop.call_later(0.3, deliver, ex, 3, "slow")
        began = loop.time()
        got = await ex._collect(3, 30.0)
        assert [g.peer for g in got] == ["slow"] and loop.time() - began < 1.5
        # the wait was for a member behind us: what a round's end beside training holds it for
        assert 0.25 < ex.ran_ahead() < 0.6, ex.ran_ahead()
        # it stays in round 4: we wait one of our rounds (1 s), not the 30 s deadline
        ex.members.records["slow"] = member("slow", 4)
        await asyncio.sleep(0.7)
        began = loop.time()
        assert await ex._collect(4, 30.0) == []
        assert 0.9 < loop.time() - began < 1.3 and 0.9 < ex.ran_ahead() < 1.3
    asyncio.run(main())


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
    asyncio.run(main())


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
    asyncio.run(main())


def test_a_push_of_a_message_a_member_already_handed_on_is_refused_unread_and_strikes_no_one():
    async def main():
        loop = asyncio.get_running_loop()
        author = NodeIdentity.generate()
        name = author.peer_id.to_base58()
        ex = exchange(loop, [member(name, 6)])
        deliver(ex, 5, name)  # a relayed copy came first
        with pytest.raises(Refusal) as refused:
            ex._check_head(make_header(author, b"me", kind=PGRAD, round=5))
        assert refused.value.reason is Reason.HELD and "HELD" not in MISBEHAVIOUR
        ex._check_head(make_header(author, b"me", kind=PGRAD, round=6))  # not held: read it
    asyncio.run(main())


def test_a_node_is_behind_once_a_majority_finished_the_round_after_its_own():
    """Members that announce round r + 2 have ended round r + 1 and collect our message of r
    now: a node still training r is behind. One member far ahead (or lying) is not a majority;
    a majority further ahead is the catch-up's (the state, not rounds ended one by one)."""
    async def main():
        loop = asyncio.get_running_loop()
        ex = exchange(loop, [member("a", 5), member("b", 5), member("c", 4)])
        assert ex._behind(3) and not ex._behind(4) and not ex._behind(2)
        ex = exchange(loop, [member("far", 90), member("b", 4), member("c", 4)])
        assert not ex._behind(3)
    asyncio.run(main())


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
        assert 1.9 < loop.time() - began < 2.5, loop.time() - began
        assert ex.ran_ahead() == 0.0  # it is not behind us: we are not ahead of it
        assert [e.peers for e in events if isinstance(e, Missing)] == [["done"]]
        # a push of it still coming in at the round's end is waited for past it
        ex = exchange(loop, [member("done", 6)])
        ex.last_collect_at = loop.time() - 0.5
        ex.transport.arriving.add(("done", 5))
        loop.call_later(2.2, deliver, ex, 5, "done")
        began = loop.time()
        assert [g.peer for g in await ex._collect(5, 30.0)] == ["done"]
        assert 2.1 < loop.time() - began < 2.6
        # a member two rounds behind is a straggler: nobody waits on it
        ex = exchange(loop, [member("behind", 3)])
        ex.last_collect_at = loop.time() - 5.0
        began = loop.time()
        assert await ex._collect(5, 30.0) == [] and loop.time() - began < 0.1
    asyncio.run(main())


class SlowHolder(HoldingTransport):
    """Serves its copies after `serve_s`: a holder on a slow link."""

    def __init__(self, copies: dict, serve_s: float):
        super().__init__(copies)
        self.serve_s = serve_s

    async def request(self, peer, kind, round_index, *, meta, timeout, streams):
        await asyncio.sleep(self.serve_s)
        return await super().request(peer, kind, round_index, meta=meta, timeout=timeout, streams=streams)


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
        assert 2.4 < loop.time() - began < 3.2, loop.time() - began
    asyncio.run(main())


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
        assert 0.45 < loop.time() - began < 0.9 and ex.ran_ahead() > 0.4
        # with two of three in step, the one behind is a straggler again: not waited for
        ex = exchange(loop, [member("a", 3), member("b", 6), member("c", 6)])
        ex.last_collect_at = loop.time() - 0.5
        deliver(ex, 5, "b")
        deliver(ex, 5, "c")
        began = loop.time()
        assert [g.peer for g in await ex._collect(5, 30.0)] == ["b", "c"]
        assert loop.time() - began < 0.1
    asyncio.run(main())


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
    asyncio.run(main())


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
        assert 0.4 < loop.time() - began < 0.9
        # from the next round on, a member that finished the round is waited for as usual
        ex.inbox.clear()
        ex.last_collect_at = loop.time() - 0.5
        ex.members.records["ahead"] = member("ahead", 9)
        began = loop.time()
        assert await ex._collect(8, 1.5) == []
        assert loop.time() - began >= 1.4
        # the swarm's first round likewise: a member may have sent its round-0 message before
        # its view listed us (CI: 9.4 s waited, 7 rounds behind); at the first collect "one of
        # our rounds" is the last round's length
        ex = exchange(loop, [member("first", 1)])
        ex.sender._round_durations = (0.5,)
        began = loop.time()
        assert await ex._collect(0, 30.0) == []
        assert 0.4 < loop.time() - began < 0.9
    asyncio.run(main())


def relayed_copy(author: NodeIdentity, holder: NodeIdentity, round_index: int,
                 tamper: bool = False) -> ReceivedMessage:
    message = OutgoingMessage.from_arrays(PGRAD, round_index, {"c": np.arange(16, dtype=np.uint8)})
    message.meta[ORIGIN] = sign_origin(author, SWARM, MANIFEST, message)
    message.meta[AUTHOR] = author.peer_id.to_base58()
    if tamper:
        message.tensors[0].data[0] = 99
    return as_received(message, delivered_by=holder)


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
        assert ASK_AFTER_S <= loop.time() - began < ASK_AFTER_S + 1.5, loop.time() - began
        assert [(e.author, e.holder) for e in events if isinstance(e, Relayed)] == [(a, h)]
        assert ex.relay.store.get(5, a) is not None  # ours to hand on in turn
    asyncio.run(main())


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
    asyncio.run(main())


class ReplayHolders(HoldingTransport):
    """Members holding copies (HoldingTransport) and their records of what their steps applied,
    served by a StepReplay as replay.py serves ours; no state: a download fails."""

    def __init__(self, loop, copies: dict, records: dict):
        super().__init__(copies)
        self.kinds: list[str] = []
        self.servers = {}  # holder -> (its identity, the StepReplay serving its records)
        for (holder, identity), steps in records.items():
            server = StepReplay(unit_swarm(loop), None, 30.0, lambda: [])
            for round_index, applied in steps.items():
                server.record(round_index, applied)
            self.servers[holder] = (identity, server)

    async def request(self, peer, kind, round_index, *, meta, timeout, streams):
        self.kinds.append(kind)
        if kind == APPLIED:
            identity, server = self.servers[peer]
            reply = await server._respond(types.SimpleNamespace(round=round_index, meta=meta))
            return as_received(reply, delivered_by=identity)
        if kind == STATE_KIND:
            raise P2PError("the holder left")
        return await super().request(peer, kind, round_index, meta=meta, timeout=timeout,
                                     streams=streams)


def test_a_node_whose_phi_left_the_majoritys_replays_its_steps_then_downloads_when_too_far():
    """Our φ of round 4 was agreed; our step of round 5 missed b's message of round 4, and a and
    b announce another φ: a's records of its steps since round 4 and b's message (fetched from
    a: kilobytes) become a recipe the training thread replays, and no state is downloaded. While
    no check agrees again, later divergent checks replay from round 4 too, until it lies more
    than REPLAY_ROUNDS back: then the state is downloaded."""
    async def main():
        loop = asyncio.get_running_loop()
        holder, author = NodeIdentity.generate(), NodeIdentity.generate()
        a, b = holder.peer_id.to_base58(), author.peer_id.to_base58()
        events: list = []
        senders = tuple(sorted([a, b, "me"]))
        transport = ReplayHolders(loop, {(a, 4, b): relayed_copy(author, holder, 4),
                                         (a, 5, b): relayed_copy(author, holder, 5)},
                                  {(a, holder): {5: (4, senders), 6: (5, senders)}})

        def view(phi_round: int, phi: str) -> list[MemberRecord]:
            return [live_member(peer, phi_round + 1, "dilocox", "training", since=0, phi=phi,
                                phi_round=phi_round) for peer in (a, b)]

        swarm = unit_swarm(loop, view(5, "0" * 32), transport=transport, events=events)
        swarm = dataclasses.replace(swarm, timeouts=NodeTimeouts(consensus_wait_s=0.2))
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        ex.relay.store.keep(4, a, relayed_copy(holder, holder, 4))  # a's own message came to us
        ex.consensus.agreed = 4
        await ex.consensus.check(5, "f" * 32)
        assert transport.kinds == [APPLIED, RELAY]  # its records, and the one message we lacked
        recipe = ex.consensus.resyncs[5]["replay"]
        assert recipe["since"] == 4 and recipe["steps"] == [(5, 4, senders)]
        assert sorted(recipe["messages"]) == sorted([(4, a), (4, b)]) and recipe["digest"] == "0" * 32
        assert [(e.round, e.source, e.steps, e.senders, e.fetched) for e in events
                if isinstance(e, ReplayReady)] == [(5, a, 1, 3, 1)]
        assert ex.consensus.pop_resync(5) is not None
        assert ex.replay.applied[5] == (4, senders)  # their step is ours now: served so
        assert ex.relay.store.get(4, b) is not None  # the fetched copy is kept for the next try
        ex.relay.store.keep(5, a, relayed_copy(holder, holder, 5))
        ex.members.records = {r.peer_id: r for r in view(6, "1" * 32)}
        await ex.consensus.check(6, "e" * 32)  # off again: both steps since round 4
        assert transport.kinds[2:] == [APPLIED, RELAY]  # b's message of round 4 is not fetched again
        assert ex.consensus.resyncs[6]["replay"]["steps"] == [(5, 4, senders), (6, 5, senders)]
        ex.members.records = {r.peer_id: r for r in view(4 + REPLAY_ROUNDS + 1, "2" * 32)}
        await ex.consensus.check(4 + REPLAY_ROUNDS + 1, "d" * 32)  # too far: the state, whole
        assert transport.kinds[-2:] == [STATE_KIND, STATE_KIND]
    asyncio.run(main())


def test_a_record_of_senders_that_cannot_be_true_is_not_read():
    """A reply naming more senders than could have sent (twice the members and us: some may
    have left), or one twice, is refused before any message is fetched for it."""
    async def main():
        loop = asyncio.get_running_loop()
        holder = NodeIdentity.generate()
        replay = StepReplay(unit_swarm(loop), None, 30.0, lambda: ["x", "y"])
        server = StepReplay(unit_swarm(loop), None, 30.0, lambda: [])

        async def reply(round_index: int, since: int):
            header = types.SimpleNamespace(round=round_index, meta={"since": since})
            return as_received(await server._respond(header), holder)
        server.record(3, (-1, ()))  # a step with nothing due (the first round, delay 1)
        assert replay._read(3, 2, await reply(3, 2)) == [(3, -1, ())]
        server.record(4, (3, ("x",)))
        for senders, ok in ((("x", "y", "me", "left"), True), (tuple("abcdefg"), False),
                            (("x", "x"), False)):
            server.record(5, (4, senders))
            if ok:
                assert replay._read(5, 3, await reply(5, 3)) == [(4, 3, ("x",)), (5, 4, senders)]
            else:
                with pytest.raises(ValueError, match="senders"):
                    replay._read(5, 3, await reply(5, 3))
        with pytest.raises(ValueError, match="records"):
            replay._read(6, 3, await reply(5, 3))  # not the rounds asked
        with pytest.raises(ValueError, match="holds 1 records"):
            replay._read(5, 3, await reply(5, 4))
        for since in (1, 5, None):  # a round it holds no record of; none; no round asked
            with pytest.raises(Refusal):
                await reply(5, since)
    asyncio.run(main())


class NoStateServer:
    """A transport whose state requests all fail, as when the majority's holder just left."""

    class limits:
        parallel_streams = 1

    async def request(self, *args, **kwargs):
        raise P2PError("the holder left")


def test_a_tie_left_for_a_missing_vote_is_broken_when_it_lasts_a_second_round():
    """Two survivors split 1:1 while a third member finished the rounds but its votes never
    arrive: the first tied round waits for that vote, a second tied round in a row is broken
    with the votes that came (the larger digest resyncs to the smaller, as its peer picks too)."""
    async def main():
        loop = asyncio.get_running_loop()
        events: list = []

        def view(round_index: int) -> list[MemberRecord]:
            other = live_member("other", round_index + 1, "dilocox", "training", since=0,
                                phi="0" * 32, phi_round=round_index)
            return [other, member("silent", round_index + 1)]  # finished, never votes

        swarm = unit_swarm(loop, view(5), transport=NoStateServer(), events=events)
        swarm = dataclasses.replace(swarm, timeouts=NodeTimeouts(consensus_wait_s=0.2))
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))

        def diverged() -> list[int]:
            return [e.round for e in events if isinstance(e, Diverged)]

        await ex.consensus.check(5, "f" * 32)  # 1:1, a vote missing: wait for it
        assert diverged() == []
        ex.members.records = {r.peer_id: r for r in view(7)}
        await ex.consensus.check(7, "f" * 32)  # a tie again, but not in the next round
        assert diverged() == []
        ex.members.records = {r.peer_id: r for r in view(8)}
        await ex.consensus.check(8, "f" * 32)  # the tie lasted: broken toward the smaller digest
        assert diverged() == [8]
        ex.members.records = {r.peer_id: r for r in view(9)}
        events.clear()
        await ex.consensus.check(9, "0" * 32)  # we hold the winner: nothing to do
        assert diverged() == []
    asyncio.run(main())


class AskedKinds(NoStateServer):
    """A transport whose requests all fail, noting the kind of each."""

    def __init__(self):
        self.kinds: list[str] = []

    async def request(self, peer, kind, *args, **kwargs):
        self.kinds.append(kind)
        raise P2PError("the holder left")


def test_agreement_needs_a_majority_of_the_expected_votes_and_a_failed_replay_downloads_next():
    """The 512 kbit/s run R8 (benchmarks/RESULTS.md, issue 18): after a 2:2 split each pair's
    check heard its partner's vote first and counted the round agreed; the pair that lost the
    tie replayed from that state, never reached the winners' digest, and tried again every
    round. A round is agreed only when our digest holds a strict majority of the votes the check
    expects (the members that finished the round before, and us): not 2 of 4, but 3 of 4, or 2
    of 3. And a replay that failed from the agreed round is not tried from it again: the next
    divergent check downloads the state, and the failed recipe's records are not served."""
    async def main():
        loop = asyncio.get_running_loop()
        transport, events = AskedKinds(), []

        def view(round_index: int, ours: set, theirs: set = frozenset(), peers="abc",
                 other="0" * 32):
            """`peers` finished the round before; `ours` announced our φ of `round_index`,
            `theirs` the `other` one, the rest have not announced it yet."""
            return [live_member(p, round_index + 1, "dilocox", "training", since=0,
                                phi="1" * 32 if p in ours else other, phi_round=round_index)
                    if p in ours | theirs else member(p, round_index) for p in peers]

        swarm = unit_swarm(loop, view(5, {"a"}), transport=transport, events=events)
        swarm = dataclasses.replace(swarm, timeouts=NodeTimeouts(consensus_wait_s=0.2))
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))

        async def check(round_index: int, records: list) -> int:
            ex.members.records = {r.peer_id: r for r in records}
            await ex.consensus.check(round_index, "1" * 32)
            return ex.consensus.agreed

        ex.consensus.agreed = 3
        assert await check(5, view(5, {"a"})) == 3  # 2 of 4: b and c may hold another φ
        assert await check(6, view(6, {"a", "b"})) == 6  # 3 of 4
        assert await check(7, view(7, {"a"}, peers="ab")) == 7  # 2 of 3
        assert await check(8, view(8, {"a"}, {"b", "c"}, other="2" * 32)) == 7  # a tie we win
        assert not transport.kinds
        assert [e.round for e in events if isinstance(e, Diverged)] == []
        ex.replay.record(9, (8, ("a", "b", "me")))  # a recipe's step, recorded as ours
        ex.consensus.replay_failed(6, None)  # a replay from a round no longer our agreed one
        assert ex.consensus.agreed == 7
        ex._replay_failed({"since": 7, "round": 9, "steps": [(9, 8, ("a", "b", "me"))]}, None)
        assert ex.consensus.agreed < -REPLAY_ROUNDS and 9 not in ex.replay.applied
        assert await check(10, view(10, set(), {"a", "b", "c"})) < 0
        assert [e.round for e in events if isinstance(e, Diverged)] == [10]
        assert transport.kinds == [STATE_KIND] * 3  # the state from each holder: no records asked
    asyncio.run(main())


def test_a_node_ahead_waits_up_to_a_round_for_the_votes_of_members_still_in_it():
    """The 512 kbit/s run R4: a node 8-10 s ahead of its two members checked each round before
    their votes came and held another φ for 18 rounds without noticing. Members still training
    the round are waited for up to one of our rounds (their votes come at its end); members that
    finished it, or a node whose pace is not known yet, only consensus_wait_s."""
    async def main():
        loop = asyncio.get_running_loop()
        events: list = []
        others = ("a", "b")
        training = [member(peer, 5) for peer in others]  # still in round 5, as we finished it
        swarm = unit_swarm(loop, training, transport=NoStateServer(), events=events)
        swarm = dataclasses.replace(swarm, timeouts=NodeTimeouts(consensus_wait_s=0.3))
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        ex.pace = 3.0  # our rounds take 3 s

        async def vote_later(delay_s: float, round_index: int) -> None:
            await asyncio.sleep(delay_s)  # they end the round, and announce their φ of it
            ex.members.records = {peer: live_member(peer, round_index + 1, "dilocox", "training",
                                                    since=0, phi="0" * 32, phi_round=round_index)
                                  for peer in others}

        voting = asyncio.create_task(vote_later(1.0, 5))
        began = loop.time()
        await ex.consensus.check(5, "f" * 32)
        await voting
        assert [e.round for e in events if isinstance(e, Diverged)] == [5], events
        assert 0.9 < loop.time() - began < 2.0
        # members past the round whose votes do not come: consensus_wait_s, as before
        ex.members.records = {peer: member(peer, 8) for peer in others}
        began = loop.time()
        await ex.consensus.check(6, "f" * 32)
        assert loop.time() - began < 0.9
        # members in the round, but our pace not known yet (our first rounds): the same
        ex.members.records = {peer: member(peer, 9) for peer in others}
        ex.pace, began = 0.0, loop.time()
        await ex.consensus.check(9, "f" * 32)
        assert loop.time() - began < 0.9
    asyncio.run(main())


def test_among_three_voters_a_lone_digest_wins_by_rank_not_by_its_smallness():
    """Issue 24: three members each announce another φ; the smallest digest (which a liar can
    grind for) would win a plain tie. A total split goes to the holder ranked first for the
    round (protocol/dilocox.py split_winner): all three heal, and the liar's small digest wins
    only in the rounds its fixed identity ranks first."""
    async def main():
        loop = asyncio.get_running_loop()
        events: list = []
        digests = {"liar": "0" * 32, "other": "e" * 32, "us": "f" * 32}
        records = [live_member(peer, 6, "dilocox", "training", since=0, phi=digest, phi_round=5)
                   for peer, digest in digests.items() if peer != "us"]
        swarm = unit_swarm(loop, records, peer_id="us", transport=NoStateServer(), events=events)
        swarm = dataclasses.replace(swarm, timeouts=NodeTimeouts(consensus_wait_s=0.2))
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        ex.consensus.tied_round = 4   # the tie lasted: it is broken now
        by_rank = {r: split_winner({d: [p] for p, d in digests.items()}, r) for r in range(5, 40)}
        split = next(r for r, d in by_rank.items() if d == "e" * 32)  # "other" ranks first
        records = [dataclasses.replace(m, round=split + 1, extra={**m.extra, "phi_round": split})
                   for m in records]
        ex.members.records = {m.peer_id: m for m in records}
        ex.consensus.tied_round = split - 1
        await ex.consensus.check(split, "f" * 32)
        assert [(e.round, e.majority) for e in events if isinstance(e, Diverged)] == [(split, "e" * 12)]
        # a round we rank first in: we hold the winner, nothing to do
        ours = next(r for r, d in by_rank.items() if d == "f" * 32)
        ex.members.records = {m.peer_id: dataclasses.replace(m, round=ours + 1,
                                                        extra={**m.extra, "phi_round": ours})
                              for m in records}
        ex.consensus.tied_round, events[:] = ours - 1, []
        await ex.consensus.check(ours, "f" * 32)
        assert [e for e in events if isinstance(e, Diverged)] == []
    asyncio.run(main())


def test_a_diverged_node_waits_for_the_check_in_flight_and_an_agreeing_one_never_does():
    """A resync is adopted at the outer step after its round, or dropped: a node whose checks
    are slower than its rounds (votes come with the slowest member) resynced every round and
    never healed. So a node known to be off the majority's φ waits, at most one of its rounds,
    for the check of the round before its step; a node that agrees does not wait at all, nor
    one whose last check heard no other vote, nor one the swarm is a round ahead of (a node
    rounds behind the others, which waited on votes that never came, fell further behind)."""
    async def main():
        loop = asyncio.get_running_loop()
        events: list = []

        def view(round_index: int, phi_round: int, phi: str = "0" * 32) -> list[MemberRecord]:
            return [live_member(peer, round_index, "dilocox", "training", since=0, phi=phi,
                                phi_round=phi_round) for peer in ("a", "b")]

        swarm = unit_swarm(loop, view(6, 5), transport=NoStateServer(), events=events)
        swarm = dataclasses.replace(swarm, timeouts=NodeTimeouts(consensus_wait_s=1.0))
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        ex.pace = 3.0  # our rounds take 3 s

        async def settle_seconds(round_index: int, wait_s: float) -> float:
            began = loop.time()
            await ex.consensus.settle(round_index, wait_s, ex.pace)
            return loop.time() - began

        ex._after_round(6, "f" * 32)  # round 6's votes are not in: the check waits for them
        assert not ex.consensus.diverged and await settle_seconds(7, 5.0) < 0.05  # agreeing so far: no wait
        await asyncio.wait(set(ex.consensus.checks.values()))
        await ex.consensus.check(5, "f" * 32)  # two members hold another φ of round 5
        assert ex.consensus.diverged and [e.round for e in events if isinstance(e, Diverged)] == [5]
        ex.members.records = {r.peer_id: r for r in view(8, 5)}  # their votes of 7 and 8 lag
        ex._after_round(7, "f" * 32)
        waited = await settle_seconds(8, 5.0)  # diverged: the check of round 7 is waited for...
        assert 0.4 < waited < 2.0 and not ex.consensus.checks, waited
        assert not ex.consensus.diverged  # it heard no other vote: nothing to wait for any more
        ex.consensus.diverged = True  # as a divergent check leaves it
        ex._after_round(8, "f" * 32)  # a check of 1 s
        assert 0.15 < await settle_seconds(9, 0.2) < 0.5  # ...at most as long as asked
        ex.pace = 0.2
        assert 0.15 < await settle_seconds(9, 5.0) < 0.5  # ...and at most one of our rounds
        assert ex.consensus.checks  # still waiting for votes
        ex.pace = 3.0
        assert await settle_seconds(10, 5.0) < 0.05  # a check of another round is not waited for
        ex.members.records = {r.peer_id: r for r in view(11, 10)}
        assert 8 in ex.consensus.checks and await settle_seconds(9, 5.0) < 0.05  # nor one the swarm is a round ahead of
        await asyncio.wait(set(ex.consensus.checks.values()))
        ex.members.records = {r.peer_id: r for r in view(6, 5)}
        await ex.consensus.check(5, "f" * 32)
        assert ex.consensus.diverged
        ex.members.records = {r.peer_id: r for r in view(10, 9, "f" * 32)}  # our φ again
        await ex.consensus.check(9, "f" * 32)
        assert not ex.consensus.diverged
        ex._after_round(10, "f" * 32)
        assert await settle_seconds(11, 5.0) < 0.05
        await asyncio.wait(set(ex.consensus.checks.values()))
    asyncio.run(main())


class FailingTransport:
    """One peer's push fails with the network's error, another's with any other error (a bound
    the send planner enforces raised ValueError, which escaped the send and vanished)."""

    async def push(self, peer, message, timeout):
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
    asyncio.run(main())


def test_a_node_two_rounds_behind_takes_the_swarms_state_and_counts_from_its_round():
    """Behind by CATCH_UP_LAG rounds, the node downloads (in the background) the state the
    daemon's StateAdoption agrees on (here a recorded answer) and takes it at a later round's
    end: its first round moves there, and it says so. One round behind it does not ask (the
    resync covers that), and a failed try is repeated only after another lag, not every round."""
    from node.daemon.state_quorum import JoinState
    from node.events import CaughtUp

    async def main():
        loop = asyncio.get_running_loop()
        events, asked = [], []
        swarm = unit_swarm(loop, [member("a", 9), member("b", 9)], events=events)
        state = {"phi": {}, "momentum": {}}
        answers = [RuntimeError("no φ digest is announced by a majority"),
                   JoinState(12, state, {"phi_round": 10, "phi": "d2"}, "b")]

        async def adopt_state(reference):
            asked.append(reference)
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        swarm.adopt_state = adopt_state
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        ex._restart_at(0)  # no φ announced: a replay has no target, the state is downloaded

        async def round_end(round_index: int):
            caught = ex.catching_up.poll(round_index, ex.consensus.agreed, {})
            await asyncio.sleep(0.05)  # the download in the background
            return caught
        assert await round_end(7) is None and asked == []  # round 8 next: one behind
        assert await round_end(5) is None and len(asked) == 1  # a try that failed...
        assert await round_end(6) is None and len(asked) == 1  # ...taken, not repeated at once
        ex.members.records = {p: member(p, 12) for p in ("a", "b")}
        assert await round_end(7) is None and len(asked) == 2  # asked; the state arrives
        got = ex.catching_up.poll(8, -1, {})
        # the majority's φ it served is of round 10, while the swarm trains round 12
        assert got == SwarmState(12, 10, state, "b", "d2") and len(asked) == 2
        assert ex.first_round == 0  # not moved until the training thread adopted it
        ex._rejoin(9, got)
        # a replay starts from the state we hold (R6: from round 11, every one was refused)
        assert ex.first_round == 12 and ex.oldest_wanted == 11 and ex.consensus.agreed == 10
        assert [(e.from_round, e.round, e.source, e.by) for e in events
                if isinstance(e, CaughtUp)] == [(9, 12, "b", "download")]
    asyncio.run(main())


def test_a_node_behind_whose_agreed_round_is_near_replays_the_swarms_steps_instead():
    """Our φ of round 4 was agreed and a and b announce one φ of round 7 (they train round 8):
    three rounds behind, the catch-up asks a for its records of steps 5-7 and b's messages we
    lack (kilobytes) instead of downloading φ and m; with no such records it downloads."""
    from node.daemon.state_quorum import JoinState
    from node.events import CaughtUp

    async def main():
        loop = asyncio.get_running_loop()
        holder, author = NodeIdentity.generate(), NodeIdentity.generate()
        a, b = holder.peer_id.to_base58(), author.peer_id.to_base58()
        senders = (a, b)
        transport = ReplayHolders(loop, {(a, r, b): relayed_copy(author, holder, r) for r in (4, 5, 6)},
                                  {(a, holder): {r: (r - 1, senders) for r in (5, 6, 7)}})
        events, downloads = [], []
        records = [live_member(p, 8, "dilocox", "training", since=0, phi="0" * 32, phi_round=7)
                   for p in senders]
        swarm = unit_swarm(loop, records, transport=transport, events=events)

        async def adopt_state(reference):
            downloads.append(reference)
            return JoinState(8, {"phi": {}, "momentum": {}}, {"phi_round": 7, "phi": "0" * 32}, a)
        swarm.adopt_state = adopt_state
        ex = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        for r in (4, 5, 6):  # a's own messages came to us
            ex.relay.store.keep(r, a, relayed_copy(holder, holder, r))
        assert ex.catching_up.poll(4, 4, {}) is None  # round 5 next, the swarm's round 8
        await asyncio.wait({ex.catching_up.task})
        got = ex.catching_up.poll(5, 4, {})
        assert got is not None and downloads == [] and transport.kinds == [APPLIED, RELAY, RELAY, RELAY]
        recipe = got.state["replay"]
        assert (got.next_round, got.state_round, got.source, got.digest) == (8, 7, a, "0" * 32)
        assert recipe["since"] == 4 and recipe["steps"] == [(r, r - 1, senders) for r in (5, 6, 7)]
        ex._rejoin(6, got)
        assert [(e.round, e.by) for e in events if isinstance(e, CaughtUp)] == [(8, "replay")]
        # further back than a replay reaches (or no holder's records): the state, downloaded
        ex.catching_up.next_try = 0
        assert ex.catching_up.poll(1, 4 - REPLAY_ROUNDS, {}) is None
        await asyncio.wait({ex.catching_up.task})
        assert ex.catching_up.poll(2, 4 - REPLAY_ROUNDS, {}).state == {"phi": {}, "momentum": {}}
        assert len(downloads) == 1
    asyncio.run(main())


class TransportAtAFixedRate:
    """Pushes take 10 µs a byte: a link whose rate the test knows."""

    async def push(self, peer, message, timeout):
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
        assert ex.send_ratio() is None  # nothing measured yet
        await ex.sender._send_all(0, small)  # 0.1 s
        ex.sender._round_durations, ex.sender._handed_bytes = (1.0,), 20_000
        assert 0.19 < ex.send_ratio() < 0.3
        ex.sender._handed_bytes = 10_000
        assert 0.09 < ex.send_ratio() < 0.15
    asyncio.run(main())


class TransportWithAFailingPeer(TransportAtAFixedRate):
    """As above, but peer "b" resets every push at once."""

    async def push(self, peer, message, timeout):
        if peer == "b":
            raise ConnectionResetError("reset by peer")
        await super().push(peer, message, timeout)


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
        before = ex.send_ratio()
        ex.members.records = {"b": member("b", 0)}  # a round whose only send fails at once
        await ex.sender._send_all(1, big)
        assert ex.send_ratio() >= before * 0.99, (before, ex.send_ratio())
    asyncio.run(main())


class TransportAtAChosenRate:
    """Each push takes `seconds` (a member's downlink that other senders share some rounds)."""
    seconds = 0.1

    async def push(self, peer, message, timeout):
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
        slow = ex.send_ratio()
        assert 0.19 < slow < 0.3
        transport.seconds = 0.02
        for r in range(1, LINK_MEMORY):
            await ex.sender._send_all(r, message)
            assert ex.send_ratio() == slow  # still within memory of the slow send
        await ex.sender._send_all(LINK_MEMORY, message)
        assert ex.send_ratio() < slow / 4  # forgotten after LINK_MEMORY faster sends
    asyncio.run(main())


class TransportWithASlowReceiver:
    """Pushes to "slow" take 0.3 s, to the others 0.01 s (or all 0.3 s: our own uplink)."""
    uplink_bound = False

    async def push(self, peer, message, timeout):
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
        assert ex.shared_ratio() == 0.0  # nothing measured
        await ex.sender._send_all(0, message)
        ex.sender._round_durations, ex.sender._handed_bytes = (2.0,), message.total_bytes
        assert 0.4 < ex.shared_ratio() < 0.5  # 3 × (0.3 − 0.01) s over a 2 s round
        assert ex.send_ratio() < 0.2          # our own link: 0.3 s of 2
        transport.uplink_bound = True
        own = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
        await own.sender._send_all(0, message)
        own.sender._round_durations, own.sender._handed_bytes = (2.0,), message.total_bytes
        assert own.shared_ratio() < 0.05
    asyncio.run(main())


class TransportThatBreaksFirst:
    """Each peer's first push breaks with `first` (then the peer takes what `then` says)."""

    def __init__(self, first: Exception, then: Exception | None = None):
        self.first, self.then, self.calls = first, then, []

    async def push(self, peer, message, timeout):
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
    asyncio.run(main())


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
        assert ex.send_ratio() == pytest.approx(10 / 16)
    asyncio.run(main())


def test_a_resync_that_came_after_its_step_is_handed_over_at_the_next():
    """The check of round 3 ended after our step of round 4 (we were ahead of the voters): its
    resync is taken at the step after round 4 (the training thread replays our step 4 over it),
    the latest of those due; older ones are dropped, later ones kept."""
    async def main():
        ex = exchange(asyncio.get_running_loop(), [])
        recipe = {"replay": {"steps": [(3, 2, ("a", "b"))]}}
        ex.consensus.resyncs = {2: {"round": 2, "slow_weights": {}, "momentum": {}}, 3: recipe,
                                6: {"round": 6}}
        assert ex.consensus.pop_resync(4) is recipe and list(ex.consensus.resyncs) == [6]
        assert ex.replay.applied[3] == (2, ("a", "b"))  # its step is ours now: served so
        assert ex.consensus.pop_resync(4) is None
    asyncio.run(main())


def test_a_committee_members_round_is_timed_per_round_not_per_send(monkeypatch):
    """A committee member sends every few rounds: one of its rounds is the time between two
    sends over the rounds between them, what the controller's send ratio compares a send with
    (timed per send, a member sending every 4th round read its link 4 times as fast)."""
    import numpy as np
    from types import SimpleNamespace

    from node.rounds.dilocox import sending
    from p2p.messages import OutgoingTensor

    clock = iter([100.0, 112.0])
    monkeypatch.setattr(sending.time, "monotonic", lambda: next(clock))
    swarm = SimpleNamespace(bridge=SimpleNamespace(spawn=lambda *args, **kwargs: None))
    sender = sending.RoundSender(swarm, 30.0, lambda: [], lambda message: None)
    tensors = [OutgoingTensor("w", "uint8", (4,), np.zeros(4, np.uint8))]
    sender.send_round(2, tensors)
    sender.send_round(6, tensors)
    assert sender.last_round_s == 3.0
