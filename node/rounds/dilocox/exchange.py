"""DiLoCoX over the swarm, the event loop's side (docs/protocols.md §3).

The training thread hands each round's compressed message to `send_round`, which pushes it to
the round's group (every live member on our manifest, at most `fan_out`, a random subset beyond)
in the background, over signed streams, each signed once by its author for every receiver so
that members can hand it on (relay.py). Received messages wait in an inbox by round until the
training thread `collect`s them (with delay = 1 they had a whole round to arrive). After each
outer step the node announces the digest of φ and checks it against its members' (consensus.py:
a φ off the majority's is replayed or downloaded); the training thread adopts either before its
next outer step. A node rounds behind the swarm takes the swarm's state (`catch_up`).

Invariants:
- a message is accepted at most once per (sender, round) (protocol/dilocox.py enforces it too),
  and never from an author that signed two versions of one (evidence.py: banned everywhere the
  proof reaches, its messages dropped);
- a push, a report or a member record naming a round beyond the bound (bounds.py) is refused, or
  left out of every wait, and a push declares at most the manifest codec's largest message;
- `collect` waits at most one of our own rounds for a member's message (asking members that may
  hold the message of one that finished the round, its record says so or its message is
  arriving, for at least `ASKING_S`), and beyond it, up to its deadline, only for a message on
  its way to us (`ON_ITS_WAY_S`). Waiting for members still in the round, a node more than a
  round ahead slows to their pace: it would otherwise refuse a slower member's every message as
  stale and split φ each round; a member more than a round behind is a straggler
  whose messages may miss the round, unless such members are the majority (`_unfinished`: then
  we are the one ahead, and wait for them as for members still in the round);
- with a committee (`senders`, protocol/committee.py) a round waits and asks only for the
  messages of members drawn to send in it, by our view of the swarm's size; a message from
  another member that comes is applied all the same (views that differ may draw differently);
- a member's round is the later of its record's and the one after its last message that came
  (`_rounds`): records come through the DHT and lag on a slow link;
- a late joiner (or a node resuming while the swarm runs) never waits for the rounds before it
  joined, and for the round it joined in (round 0 too) at most one of its own rounds: members
  may have sent those messages before they knew of it;
- the message of a member that finished the round (its record says so, or a member reported
  holding its signed message) and has not come to us is asked of the members that hold it,
  its author last (node/rounds/dilocox/relay.py: a push that broke, or, in a swarm larger
  than the fan-out, one that went to a random subset of members): every copy is checked against
  its author's signature, and every member applies the same messages;
- a node still training a round that a majority of its members finished a round ago (it
  resumed, or caught up, late in their round, or trained slower), and not further behind, ends
  that round at its next step (link.is_behind, DiLoCoXRound.between_steps): its message then
  comes while they still wait for it, and it starts their round with them (at equal speeds it
  would otherwise stay a round behind, its every message late). A node ahead is held back by
  its own wait for them (`ran_ahead_s`, which a round's end beside training makes training
  wait as long: node/daemon/worker.py);
- a node `CATCH_UP_LAG` or more rounds behind the round a majority of its members reached (it
  stalled, or joined from a stale view of the swarm) takes the swarm's state, replayed or
  downloaded (catch_up.py), and trains on from the swarm's round: nothing else would bring it
  back, since every member refuses its messages as stale and the consensus check finds no vote
  for the rounds it compares.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable

from node.config.manifest import ProtocolSection
from node.events import CaughtUp, Equivocated, Missing, Stored
from node.rounds.dilocox.bounds import RoundBound
from node.rounds.dilocox.catch_up import SwarmCatchUp
from node.rounds.dilocox.consensus import PhiConsensus
from node.rounds.dilocox.evidence import Equivocations, Proof
from node.rounds.dilocox.link import (REPLAY_ROUNDS, Agreement, Collected, GroupMessage, Refused,
                                      Rejoined, Replay, ReplayFailed, Report, SendCosts, Stepped,
                                      SwarmState)
from node.rounds.dilocox.relay import Relay
from node.rounds.dilocox.replay import StepReplay
from node.rounds.dilocox.sending import PGRAD, RoundSender
from node.rounds.state import agreed_round, settled
from node.rounds.swarm import Swarm, peer_name
from p2p.errors import Reason, Refusal
from p2p.messages import ReceivedMessage
from protocol.committee import send_share, sends

log = logging.getLogger("lowcomm.dilocox")
WATCH_S = 0.25  # how often the messages that did not come are looked for (relay.py)
# Past one of our rounds, and at least ASKING_S, a collect waits (up to its deadline) only for
# a message on its way: a push from its author or a copy from a holder coming in now, or less
# than ON_ITS_WAY_S ago (a broken push is tried again a second later: sending.py). A member
# that finished the round and sent us nothing is then given up (a split that follows is
# repaired). ASKING_S bounds below the time a message needs to reach the members that hold it
# and a relay to find it there.
ASKING_S = 15.0
ON_ITS_WAY_S = 3.0


class DiLoCoXExchange:
    def __init__(self, config: ProtocolSection, swarm: Swarm, rng: random.Random, *,
                 clock: Callable[[], float] | None = None):
        """`clock`: seconds, monotonic, read by every part of the exchange (the loop's time
        unless given: the waits are the loop's timers, so a test gives the loop a virtual clock,
        tests/virtual_time.py)."""
        self.swarm, self.rng = swarm, rng
        self.clock = clock or swarm.loop.time
        self.loop, self.transport, self.members = swarm.loop, swarm.transport, swarm.members
        self.peer_id, self.publish = swarm.peer_id, swarm.publish
        self.fan_out, self.deadline_s = config.fan_out, config.message_deadline_s
        self.senders = config.senders  # the committee's size, about (protocol/committee.py)
        self.tenure = config.senders_tenure
        self.inbox: dict[int, dict[str, ReceivedMessage]] = {}
        self.heard: dict[str, int] = {}  # member -> the latest round whose message came from it
        # rounds no member may name (bounds.py); versions of one message compared (evidence.py)
        self.bound = RoundBound(swarm, own_round=lambda: max(self.collected + 2, self.first_round))
        self.evidence = Equivocations(swarm, PGRAD, members=self._members,
                                      check_round=self.bound.check, on_proof=self._equivocated,
                                      clock=self.clock)
        self.relay = Relay(swarm, PGRAD, witness=self.evidence.accepted,  # signs, keeps, serves, fetches
                           clock=self.clock)
        self._watch: asyncio.Task | None = None  # asks for messages that did not come (relay.py)
        self.sender = RoundSender(swarm, self.group, self.relay.sign, clock=self.clock,
                                  keep=self.relay.keep_own)
        self.replay = StepReplay(swarm, self.relay, self._members)
        self.consensus = PhiConsensus(swarm, self.replay,
                                      finished=self._finished, in_round=self._in_round,
                                      pace=lambda: self.pace, clock=self.clock)
        self.arrived = asyncio.Event()
        self.oldest_wanted = 0
        self.first_round = 0  # the round this node (re)started at: see _collect
        self.collected = -1  # the last round collected
        self.last_collect_at: float | None = None  # our pace: how long we wait for a member in the round
        self.pace = 0.0  # seconds between our last two collects: one of our rounds
        self.ran_ahead_s = 0.0  # of the last collect's wait, the part for members still in its round
        self.swarm_round = -1  # the round a majority of our members reached (`_watch_missing`)
        self.catching_up = SwarmCatchUp(swarm, self.replay)  # when we fall rounds behind

    def start(self, round_index: int) -> None:
        self._restart_at(round_index)
        self.transport.on_push(PGRAD, self._on_message, accept_round=lambda r: r >= self.oldest_wanted,
                               accept_bytes=self._fits,
                               check_head=self._check_head)
        self.evidence.start()
        self.relay.start()
        self.replay.start()
        self._watch = self.swarm.tasks.spawn(self._watch_missing(), "dilocox missing messages")

    def _restart_at(self, round_index: int, state_round: int | None = None) -> None:
        """Takes part from `round_index` on (at start, or after catching up): the rounds before
        it are never waited for (see _collect). `state_round`: the round of the swarm's state we
        start from, if not the one before `round_index`."""
        self.oldest_wanted = max(0, round_index - 1)  # the oldest round whose messages we take
        self.first_round = round_index
        # the state we start from, the swarm's or the initial φ, is agreed: a replay starts there
        self.consensus.restart_at(round_index, state_round)

    def _forget_collected(self) -> None:
        for old in [r for r in self.inbox if r < self.oldest_wanted]:
            del self.inbox[old]

    async def stop(self) -> None:
        """Ends the consensus checks and a catch-up still running (the node is leaving)."""
        running = [*self.consensus.checks.values(), *([self._watch] if self._watch else [])]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        await self.catching_up.stop()

    def _members(self) -> list[str]:
        # not a member still joining: its exchange is not listening yet (a push would be refused)
        return sorted(r.peer_id for r in settled(self.members.eligible()))

    def _share(self) -> float:
        """The committee's p from our view of the swarm (its members and us)."""
        return send_share(self.senders, len(self._members()) + 1)

    def _in_committee(self, round_index: int, peers: set[str]) -> set[str]:
        """Of `peers`, those drawn to send in `round_index`: the only ones whose message a round
        waits or asks for (all of them without a committee)."""
        share = self._share()
        return {peer for peer in peers if sends(peer, round_index, share, self.tenure)}

    def group(self) -> list[str]:
        peers = self._members()
        return peers if len(peers) <= self.fan_out else self.rng.sample(peers, self.fan_out)

    # ------------------------------------------------ training thread side (link.py DiLoCoXLink)
    def in_committee(self, round_index: int) -> bool:
        return self.swarm.bridge.call("the committee's draw", lambda: bool(
            self._in_committee(round_index, {self.peer_id})))

    def send_round(self, round_index: int, tensors: list) -> None:
        self.sender.send_round(round_index, tensors)

    def costs(self) -> SendCosts:
        return self.sender.costs()

    def collect(self, round_index: int, wait_s: float) -> Collected:
        async def collected() -> Collected:
            messages = await self._collect(round_index, wait_s)
            return Collected(messages, self.ran_ahead_s)
        return self.swarm.bridge.call(f"the messages of round {round_index}", collected,
                                      wait_s=wait_s)

    def take_if_complete(self, round_index: int) -> list[GroupMessage] | None:
        return self.swarm.bridge.call(f"round {round_index} if complete", self._take_if_complete,
                                      round_index)

    def resync(self, round_index: int, wait_s: float) -> Agreement:
        """While this node is known to be off the majority's φ, first waits at most `wait_s`
        (and one of our rounds) for the consensus check of the round before, whose repair is
        due at this step (PhiConsensus.settle); a node that agrees never waits here."""
        async def agreement() -> Agreement:
            if wait_s > 0:
                await self.consensus.settle(round_index, wait_s, self.pace)
            return Agreement(self.consensus.agreed, self.consensus.pop_resync(round_index - 1))
        return self.swarm.bridge.call("the consensus check in flight", agreement, wait_s=wait_s)

    def catch_up(self, round_index: int, reference: dict) -> SwarmState | None:
        """catch_up.py: the state comes in the background (the training thread never waits for
        it, so a stop is never held up) and is taken at a later round's end."""
        return self.swarm.bridge.call("a catch-up to the swarm", self.catching_up.poll,
                                      round_index, self.consensus.agreed, reference)

    def report(self, note: Report) -> None:
        if isinstance(note, Refused):
            self.swarm.refuse_from_thread(note.peer, note.reason, note.sentence)
        else:
            self.swarm.bridge.post(self._reported, note)

    # ------------------------------------------------------------------ loop side
    def _check_head(self, header) -> None:
        """Before a push's payload is read: refused with a strike when its round is beyond
        what an honest member can be in (bounds.py); BANNED when its header is a second signed
        version of the author's message of the round (proof: evidence.py); and HELD, which
        strikes no one, when we hold the message (an author's push and a relayed copy may cross)."""
        author = peer_name(header.sender)
        self.bound.check(author, header.round)
        self.evidence.check_push(author, header)
        self._refuse_if_held(author, header.round)

    def _fits(self, declared: int) -> bool:
        """A push declares at most the largest message the manifest's codec sends."""
        bound = self.swarm.round_message_bytes
        return bound is None or declared <= bound

    def _refuse_if_held(self, author: str, round_index: int) -> None:
        if author in self.inbox.get(round_index, {}):
            raise Refusal(Reason.HELD, f"a message of round {round_index} already arrived")

    async def _on_message(self, received: ReceivedMessage) -> None:
        sender = peer_name(received.sender)
        if self.swarm.bans.is_banned(sender):
            raise Refusal(Reason.BANNED, "banned for refused contributions")
        if not await self.loop.run_in_executor(None, self.relay.authored_by, sender, received):
            raise Refusal(Reason.BAD_SIGNATURE, "its origin signature is missing or does not match "
                          "its content: the sender must run this version of lowcomm-node")
        self._refuse_if_held(sender, received.round)  # a relayed copy may have come meanwhile
        self._accept(sender, received)

    def _take_relayed(self, author: str, copy: ReceivedMessage) -> None:
        """A checked copy of `author`'s message, fetched from another member (relay.py); not
        once its round was collected, nor after its own push came."""
        if copy.round >= self.oldest_wanted and author not in self.inbox.get(copy.round, {}):
            self._accept(author, copy)

    def _accept(self, author: str, message: ReceivedMessage) -> None:
        """Into the relay's store, the inbox, and our view of the author's round; not a second
        version of the author's message of the round, nor any message of an author proven to
        have signed two (evidence.py)."""
        if not self.relay.accepted(author, message):
            return
        self.inbox.setdefault(message.round, {})[author] = message
        self.heard[author] = max(self.heard.get(author, -1), message.round)
        self.arrived.set()

    async def _watch_missing(self) -> None:
        """Every WATCH_S, asks for the messages of rounds not yet collected whose authors finished
        the round and did not send them to us, so that they are here before the round's end."""
        while True:
            await asyncio.sleep(WATCH_S)
            self._refresh_swarm_round()
            self.evidence.report()  # the versions we accepted, to the members (evidence.py)
            # not the round a collect waits for: it asks for that one itself, and stops asking
            # past one of our rounds
            for round_index in range(max(self.first_round, self.collected + 1), self.collected + 3):
                box = self.inbox.get(round_index, {})
                self._ask_for(round_index, self._in_committee(
                    round_index, self._finished(round_index)) - set(box))

    def _refresh_swarm_round(self) -> None:
        """The round a majority of our members reached, kept as fresh as a waiting decision's:
        the training thread reads it between every two steps (link.is_behind)."""
        self.members.want_fresh()
        self.swarm_round = agreed_round(self.members.eligible())

    def _ask_for(self, round_index: int, authors: set[str]) -> None:
        if authors:
            self.relay.ask(round_index, sorted(authors),
                           lambda author: self._holders(round_index, author), self._take_relayed)

    def _holders(self, round_index: int, author: str) -> list[str]:
        """Whom to ask for `author`'s message: members that finished the round first (they
        waited for it), then the others, each in a random order, and the author last (it keeps
        its own: relay.py)."""
        finished = sorted(self._finished(round_index) - {author})
        others = sorted(set(self._members()) - set(finished) - {author})
        self.rng.shuffle(finished)
        self.rng.shuffle(others)
        return finished + others + [author]

    def _rounds(self, round_index: int) -> dict[str, int]:
        """The round each member that took part in `round_index` (joined at or before it,
        announced `since`) trains now, by the freshest word of it: its record, or its message of
        the round before, which came to us (records come through the DHT, and on a slow link
        they lag)."""
        return {r.peer_id: max(r.round, self.heard.get(r.peer_id, -1) + 1)
                for r in self.bound.plausible(self.members.eligible())
                if isinstance(r.extra.get("since"), int) and r.extra["since"] <= round_index}

    def _finished(self, round_index: int) -> set[str]:
        """Members that took part in `round_index` and finished it: they sent their message, or
        a member reported holding its signed version (evidence.py: records lag that report)."""
        signed = self.evidence.authors(round_index)
        return {peer for peer, at in self._rounds(round_index).items()
                if at > round_index or peer in signed}

    def _arriving(self, round_index: int) -> set[str]:
        """Members whose message of the round is on its way to us: they finished the round,
        whatever their record says (a record may lag the push it announced)."""
        return {peer for peer in self._members() if self.transport.receiving(peer, PGRAD, round_index)}

    def _in_round(self, round_index: int) -> set[str]:
        """Members that took part in `round_index` and are still training it."""
        return {peer for peer, at in self._rounds(round_index).items() if at == round_index}

    def _unfinished(self, round_index: int) -> set[str]:
        """Members that took part in `round_index` and have not finished it, whom a collect
        waits for at most one of our rounds: those still in it; and those behind it too when
        the members that have not finished it outnumber us and those that did: then we are the
        one ahead, and waiting one of our rounds each round slows our pace to theirs (a tie
        waits for no one behind: a straggler must not halve a pair's pace)."""
        rounds = self._rounds(round_index)
        unfinished = {peer for peer, at in rounds.items() if at <= round_index}
        if len(unfinished) > len(rounds) - len(unfinished) + 1:  # + 1: we finished it
            return unfinished
        return {peer for peer in unfinished if rounds[peer] == round_index}

    async def _take_if_complete(self, round_index: int) -> list[GroupMessage] | None:
        return await self._collect(round_index, 0.0) if self._complete(round_index) else None

    def _complete(self, round_index: int) -> bool:
        """Every member a collect of the round would wait for (those that finished it, those
        still in it, and those behind it when they are the majority: `_unfinished`) has sent us
        its message, and no consensus check is running (a resync it brings must be adopted
        before the next outer step, which `apply_on_arrival` would take early). Never true for
        the rounds a (re)joining node may have missed: those wait for the round's end as before.
        Beyond the fan-out the messages not sent to us are fetched from members (relay.py)."""
        if round_index < self.first_round or round_index <= self.collected or self.consensus.checks:
            return False
        box = self.inbox.get(round_index, {})
        return not self._in_committee(round_index, self._finished(round_index)
                                      | self._unfinished(round_index)) - set(box)

    async def _collect(self, round_index: int, wait_s: float) -> list[GroupMessage]:
        self.ran_ahead_s = 0.0
        if round_index <= self.collected:
            return []  # taken mid-round (apply_on_arrival): what came since is for no one
        self.collected = round_index
        now = self.clock()
        # one of our rounds: between our last two collects, or at the first our last round's
        # length (the training thread replaces that tuple whole)
        pace = now - self.last_collect_at if self.last_collect_at is not None else self.sender.last_round_s
        self.pace = pace
        self.last_collect_at = now
        if round_index < self.first_round:
            # Sent before this node (re)joined: members whose group did not list us yet never
            # send them, so waiting would only stall the first round for the whole deadline. We
            # take what came; a φ that then differs is resynced from the majority.
            wait_s = 0.0
        deadline = now + wait_s
        laggard_deadline = now + min(wait_s, pace)
        # for a message that did not come, the round at least as long as a relay needs to find it
        asking_deadline = now + min(wait_s, max(pace, ASKING_S))
        if self.first_round == round_index:
            # The first round we take part in (the swarm's first, or the one we joined late in):
            # a member may have ended it before its member cache listed us, and then it never
            # sends us that message. Waiting the whole deadline for it would stall us; we wait as
            # long as for a member still in the round.
            deadline = asking_deadline = laggard_deadline
        ahead_until = now  # until when we waited for members still training the round
        on_its_way: dict[str, float] = {}  # member -> when its message was last on its way to us
        given_up: set[str] = set()
        while True:
            box = self.inbox.get(round_index, {})
            at = self.clock()
            for peer in self._arriving(round_index) | self.relay.fetching(round_index):
                on_its_way[peer] = at
            unsent = (self._in_committee(round_index, self._finished(round_index))
                      | set(on_its_way)) - set(box)
            if at < asking_deadline:
                # a member that finished the round and whose message has not come: another
                # member may hold it (its push to us broke, or went to a subset beyond the fan-out)
                self._ask_for(round_index, unsent)
            else:  # past it only a message on its way holds us
                quiet = {peer for peer in unsent if at - on_its_way.get(peer, -math.inf) > ON_ITS_WAY_S}
                given_up |= quiet
                unsent -= quiet
            laggards = self._in_committee(round_index, self._unfinished(round_index)) - set(box) \
                if at < laggard_deadline else set()
            missing = unsent | laggards
            if not missing or at >= deadline:
                break
            remaining = min(d - at for d in (deadline, asking_deadline, laggard_deadline) if d > at)
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass  # members may have moved on: recompute who is missing
            if laggards:
                ahead_until = self.clock()
        self.ran_ahead_s = ahead_until - now
        self.relay.stop_asking(round_index)
        self.relay.store.forget_before(round_index - REPLAY_ROUNDS + 1)
        self.evidence.forget_before(round_index - REPLAY_ROUNDS + 1)
        self.publish(Stored(round=round_index, bytes=self.relay.store.bytes,
                            furthest_round=max((r for r, _ in self.relay.store.messages), default=-1)))
        box = self.inbox.pop(round_index, {})
        if missing := (missing | given_up) - set(box):
            self.publish(Missing(round=round_index, peers=sorted(missing)))
        self.oldest_wanted = round_index + 1
        self._forget_collected()
        return [GroupMessage(peer, round_index, msg) for peer, msg in sorted(box.items())]

    def _equivocated(self, proof: Proof) -> None:
        """`proof.author` signed two versions of its message of a round: banned, and its
        messages dropped from the rounds not collected and from the store (evidence.py)."""
        author = proof.author
        self.swarm.bans.ban_now(author, "equivocation", f"{author} signed two versions of its "
                                f"message of round {proof.first.round}", self.transport.ban)
        for box in self.inbox.values():
            box.pop(author, None)
        self.relay.store.drop(author)
        self.publish(Equivocated(round=proof.first.round, author=author))

    def _reported(self, note: Stepped | ReplayFailed | Rejoined) -> None:
        if isinstance(note, Stepped):
            self.replay.record(note.round, note.applied)
            self.members.update(round=note.round + 1, status="training")
            self.consensus.start(note.round, note.digest)
        elif isinstance(note, ReplayFailed):
            for step, _, _ in note.replay.steps:  # recorded as ours when the recipe was handed over
                self.replay.record(step, None)
            self.consensus.replay_failed(note.replay.since, note.start)
        else:
            self._rejoin(note.from_round, note.state)

    def _rejoin(self, from_round: int, got: SwarmState) -> None:
        """The training thread adopted the swarm's state instead of training `from_round`: we
        take part from the swarm's round on, and say so."""
        # a downloaded state may be of a round before the swarm's last (the φ its majority
        # announced): our agreed round is that state's, so that a replay of the steps since
        # starts where our φ is
        self._restart_at(got.next_round, got.state_round)
        self._forget_collected()
        self.members.update(round=got.next_round, status="training", extra={"since": got.next_round})
        self.publish(CaughtUp(source=got.source, from_round=from_round, round=got.next_round,
                              state_round=got.state_round, digest=got.digest,
                              by="replay" if isinstance(got.state, Replay) else "download"))
