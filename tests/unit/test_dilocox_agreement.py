"""DiLoCoXExchange's agreement on the event loop, without a network: the consensus check's votes,
the replay of the swarm's steps after a split, and the catch-up of a node rounds behind
(tests/dilocox_parts.py builds the swarm)."""

import asyncio
import dataclasses
import random
import types

import pytest

from node.config.manifest import ProtocolSection
from node.config.settings import NodeTimeouts
from node.events import Diverged, ReplayReady
from node.rounds.dilocox.exchange import DiLoCoXExchange
from node.rounds.dilocox.link import REPLAY_ROUNDS, Download, Replay, ReplayFailed, Stepped, SwarmState
from node.rounds.dilocox.relay import RELAY
from node.rounds.dilocox.replay import APPLIED, StepReplay
from node.rounds.state import STATE_KIND
from p2p.errors import P2PError, Refusal
from p2p.identity import NodeIdentity
from p2p.limits import TransferLimits
from p2p.records import MemberRecord
from protocol.vote import split_winner
from tests.dilocox_parts import HoldingTransport, exchange, member, relayed_copy
from tests.p2p_helpers import as_received
from tests.swarm_parts import member as live_member
from tests.swarm_parts import unit_swarm
from tests.virtual_time import run as run_virtual

REFRESH_S = NodeTimeouts().member_refresh_s  # the consensus check looks at the votes this often


class ReplayHolders(HoldingTransport):
    """Members holding copies (HoldingTransport) and their records of what their steps applied,
    served by a StepReplay as replay.py serves ours; no state: a download fails."""

    def __init__(self, loop, copies: dict, records: dict):
        super().__init__(copies)
        self.kinds: list[str] = []
        self.servers = {}  # holder -> (its identity, the StepReplay serving its records)
        for (holder, identity), steps in records.items():
            server = StepReplay(unit_swarm(loop), None, lambda: [])
            for round_index, applied in steps.items():
                server.record(round_index, applied)
            self.servers[holder] = (identity, server)

    async def request(self, peer, kind, round_index, *, meta, streams, need_by=None, expected_reply_bytes=0):
        self.kinds.append(kind)
        if kind == APPLIED:
            identity, server = self.servers[peer]
            reply = await server._respond(types.SimpleNamespace(round=round_index, meta=meta))
            return as_received(reply, delivered_by=identity)
        if kind == STATE_KIND:
            raise P2PError("the holder left")
        return await super().request(peer, kind, round_index, meta=meta, need_by=need_by,
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
        recipe = ex.consensus.resyncs[5]
        assert recipe.since == 4 and recipe.steps == [(5, 4, senders)]
        assert sorted(recipe.messages) == sorted([(4, a), (4, b)]) and recipe.digest == "0" * 32
        assert [(e.round, e.source, e.steps, e.senders, e.fetched) for e in events
                if isinstance(e, ReplayReady)] == [(5, a, 1, 3, 1)]
        assert ex.consensus.pop_resync(5) is not None
        assert ex.replay.applied[5] == (4, senders)  # their step is ours now: served so
        assert ex.relay.store.get(4, b) is not None  # the fetched copy is kept for the next try
        ex.relay.store.keep(5, a, relayed_copy(holder, holder, 5))
        ex.members.records = {r.peer_id: r for r in view(6, "1" * 32)}
        await ex.consensus.check(6, "e" * 32)  # off again: both steps since round 4
        assert transport.kinds[2:] == [APPLIED, RELAY]  # b's message of round 4 is not fetched again
        assert ex.consensus.resyncs[6].steps == [(5, 4, senders), (6, 5, senders)]
        ex.members.records = {r.peer_id: r for r in view(4 + REPLAY_ROUNDS + 1, "2" * 32)}
        await ex.consensus.check(4 + REPLAY_ROUNDS + 1, "d" * 32)  # too far: the state, whole
        assert transport.kinds[-2:] == [STATE_KIND, STATE_KIND]
    run_virtual(main())


def test_a_record_of_senders_that_cannot_be_true_is_not_read():
    """A reply naming more senders than could have sent (twice the members and us: some may
    have left), or one twice, is refused before any message is fetched for it."""
    async def main():
        loop = asyncio.get_running_loop()
        holder = NodeIdentity.generate()
        replay = StepReplay(unit_swarm(loop), None, lambda: ["x", "y"])
        server = StepReplay(unit_swarm(loop), None, lambda: [])

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
    run_virtual(main())


class NoStateServer:
    """A transport whose state requests all fail, as when the majority's holder just left."""

    limits = TransferLimits(parallel_streams=1)

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
    run_virtual(main())


class AskedKinds(NoStateServer):
    """A transport whose requests all fail, noting the kind of each."""

    def __init__(self):
        self.kinds: list[str] = []

    async def request(self, peer, kind, *args, **kwargs):
        self.kinds.append(kind)
        raise P2PError("the holder left")


def test_agreement_needs_a_majority_of_the_expected_votes_and_a_failed_replay_downloads_next():
    """The 512 kbit/s run R8 (benchmarks/NOTEBOOK.md, issue 18): after a 2:2 split each pair's
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
        ex._reported(ReplayFailed(Replay(7, 9, [(9, 8, ("a", "b", "me"))], {}, ""), None))
        assert ex.consensus.agreed < -REPLAY_ROUNDS and 9 not in ex.replay.applied
        assert await check(10, view(10, set(), {"a", "b", "c"})) < 0
        assert [e.round for e in events if isinstance(e, Diverged)] == [10]
        assert transport.kinds == [STATE_KIND] * 3  # the state from each holder: no records asked
    run_virtual(main())


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

        voting = asyncio.create_task(vote_later(0.9, 5))
        began = loop.time()
        await ex.consensus.check(5, "f" * 32)
        await voting
        assert [e.round for e in events if isinstance(e, Diverged)] == [5], events
        assert loop.time() - began == pytest.approx(2 * REFRESH_S)  # the look after the votes came
        # members past the round whose votes do not come: consensus_wait_s, as before
        ex.members.records = {peer: member(peer, 8) for peer in others}
        began = loop.time()
        await ex.consensus.check(6, "f" * 32)
        assert loop.time() - began == pytest.approx(REFRESH_S)  # the look past consensus_wait_s
        # members in the round, but our pace not known yet (our first rounds): the same
        ex.members.records = {peer: member(peer, 9) for peer in others}
        ex.pace, began = 0.0, loop.time()
        await ex.consensus.check(9, "f" * 32)
        assert loop.time() - began == pytest.approx(REFRESH_S)
    run_virtual(main())


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
    run_virtual(main())


def test_a_diverged_node_waits_for_the_check_in_flight_and_an_agreeing_one_once_it_heard_a_vote():
    """A resync is adopted at the outer step after its round, or dropped: a node whose checks
    are slower than its rounds (votes come with the slowest member) resynced every round and
    never healed. So a node known to be off the majority's φ waits, at most one of its rounds,
    for the check of the round before its step, and so does a node that agrees so far once a
    member's φ of that round came (a step on a φ about to be repaired splits its round too);
    not one that heard no other vote, nor one the swarm is a round ahead of (a node rounds
    behind the others, which waited on votes that never came, fell further behind)."""
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

        ex._reported(Stepped(6, "f" * 32))  # round 6's votes are not in: the check waits for them
        assert not ex.consensus.diverged and await settle_seconds(7, 5.0) == 0  # no other vote: no wait
        # a's φ of round 6 came, b's vote lags its record: the check is waited for, to its end
        ex.members.records = {r.peer_id: r for r in [*view(7, 6, "f" * 32)[:1], *view(7, 5)[1:]]}
        assert await settle_seconds(7, 5.0) == pytest.approx(1.0) and not ex.consensus.checks
        ex.members.records = {r.peer_id: r for r in view(6, 5)}
        await ex.consensus.check(5, "f" * 32)  # two members hold another φ of round 5
        assert ex.consensus.diverged and [e.round for e in events if isinstance(e, Diverged)] == [5]
        ex.members.records = {r.peer_id: r for r in view(8, 5)}  # their votes of 7 and 8 lag
        ex._reported(Stepped(7, "f" * 32))
        waited = await settle_seconds(8, 5.0)  # diverged: the check of round 7 is waited for...
        assert waited == pytest.approx(1.0) and not ex.consensus.checks  # consensus_wait_s
        assert not ex.consensus.diverged  # it heard no other vote: nothing to wait for any more
        ex.consensus.diverged = True  # as a divergent check leaves it
        ex._reported(Stepped(8, "f" * 32))  # a check of 1 s
        assert await settle_seconds(9, 0.2) == pytest.approx(0.2)  # ...at most as long as asked
        ex.pace = 0.2
        assert await settle_seconds(9, 5.0) == pytest.approx(0.2)  # ...and at most one of our rounds
        assert ex.consensus.checks  # still waiting for votes
        ex.pace = 3.0
        assert await settle_seconds(10, 5.0) == 0  # a check of another round is not waited for
        ex.members.records = {r.peer_id: r for r in view(11, 10)}
        assert 8 in ex.consensus.checks and await settle_seconds(9, 5.0) == 0  # nor one the swarm is a round ahead of
        await asyncio.wait(set(ex.consensus.checks.values()))
        ex.members.records = {r.peer_id: r for r in view(6, 5)}
        await ex.consensus.check(5, "f" * 32)
        assert ex.consensus.diverged
        ex.members.records = {r.peer_id: r for r in view(10, 9, "f" * 32)}  # our φ again
        await ex.consensus.check(9, "f" * 32)
        assert not ex.consensus.diverged
        ex._reported(Stepped(10, "f" * 32))
        assert await settle_seconds(11, 5.0) == 0
        await asyncio.wait(set(ex.consensus.checks.values()))
    run_virtual(main())


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
        assert got == SwarmState(12, 10, Download(10, {}, {}, "b"), "b", "d2") and len(asked) == 2
        assert ex.first_round == 0  # not moved until the training thread adopted it
        ex._rejoin(9, got)
        # a replay starts from the state we hold (R6: from round 11, every one was refused)
        assert ex.first_round == 12 and ex.oldest_wanted == 11 and ex.consensus.agreed == 10
        assert [(e.from_round, e.round, e.source, e.by) for e in events
                if isinstance(e, CaughtUp)] == [(9, 12, "b", "download")]
    run_virtual(main())


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
        recipe = got.state
        assert (got.next_round, got.state_round, got.source, got.digest) == (8, 7, a, "0" * 32)
        assert recipe.since == 4 and recipe.steps == [(r, r - 1, senders) for r in (5, 6, 7)]
        ex._rejoin(6, got)
        assert [(e.round, e.by) for e in events if isinstance(e, CaughtUp)] == [(8, "replay")]
        # further back than a replay reaches (or no holder's records): the state, downloaded
        ex.catching_up.next_try = 0
        assert ex.catching_up.poll(1, 4 - REPLAY_ROUNDS, {}) is None
        await asyncio.wait({ex.catching_up.task})
        assert ex.catching_up.poll(2, 4 - REPLAY_ROUNDS, {}).state.phi == {}
        assert len(downloads) == 1
    run_virtual(main())


def test_a_resync_that_came_after_its_step_is_handed_over_at_the_next():
    """The check of round 3 ended after our step of round 4 (we were ahead of the voters): its
    resync is taken at the step after round 4 (the training thread replays our step 4 over it),
    the latest of those due; older ones are dropped, later ones kept."""
    async def main():
        ex = exchange(asyncio.get_running_loop(), [])
        recipe = Replay(2, 3, [(3, 2, ("a", "b"))], {}, "")
        ex.consensus.resyncs = {2: Download(2, {}, {}), 3: recipe, 6: Download(6, {}, {})}
        assert ex.consensus.pop_resync(4) is recipe and list(ex.consensus.resyncs) == [6]
        assert ex.replay.applied[3] == (2, ("a", "b"))  # its step is ours now: served so
        assert ex.consensus.pop_resync(4) is None
    run_virtual(main())
