"""Is our φ the majority's? The check after each DiLoCoX outer step, the event loop's side
(docs/protocols.md §3: "the agreed state is bitwise identical on honest nodes").

After each outer step the node announces the digest of φ (the member record's `phi`); the check
waits for the members that reach the same round to announce theirs and compares. When the
majority announced another digest, the node first tries to replay its steps since its last
agreed round over the majority's messages (replay.py), and otherwise downloads that majority's
state from one of its holders and checks its digest; either waits in `resyncs` until the
training thread takes it before its next outer step (`pop_resync`).

Invariants:
- a check waits consensus_wait_s for the votes of its round, and as long as one of our rounds
  while members still train that round: their votes come only at its end, and a node ahead
  that stopped waiting sooner would never compare its φ with theirs;
- every node picks the same winner from the same votes (`winning_digest`: ties go to the
  smallest digest; a total split of three or more lone digests to the digest of the holder
  ranked first for the round, `split_winner`, which a liar cannot grind), so a split is healed,
  not kept; a tie waits for missing votes one round at most (`tied_round`), so a vote that
  never comes cannot keep it;
- a round counts as agreed (`agreed`, where a replay starts) only when our digest holds a
  strict majority of the votes the check expects (the members that finished the round before,
  and us), not just two of those that came: two sides of a split cannot both count a round
  agreed, so a replay never starts from a state that was not the majority's;
- a divergent check tries a replay first, from the last round a check found agreed (`agreed`),
  while that is at most REPLAY_ROUNDS back; then it downloads the state. A replay that did not
  give the majority's φ (`replay_failed`) is not tried again from that round: the next one
  starts from the agreed state the training thread held before it, and with none the next
  divergent check downloads;
- a downloaded state is used only if its digest equals the winning digest for that round; a
  holder that serves another φ for that round is banned; the training thread checks the state
  as a contribution;
- a resync is due at the outer step after its round, so a node whose last check found it
  diverged, or that heard a member's φ of that round, waits for that round's check at its
  round's end (`settle`, at most one of its rounds, and not once the swarm is a round ahead):
  a split is repaired at that step, not carried into it; checks end with the slowest member's
  vote, later than a short round; one that comes later still is taken at the next step, and
  our own steps since its round are replayed over it (round.py `_adopt_round`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from node.events import Diverged, ResyncReady
from node.rounds.dilocox.link import Download, Replay
from node.rounds.dilocox.replay import StepReplay
from node.rounds.state import agreed_round, phi_holders
from node.rounds.state_fetch import StateFetchFailed, fetch_state
from node.rounds.state import majority as state_majority
from node.rounds.swarm import Swarm
from protocol.vote import split_winner, winning_digest

log = logging.getLogger("lowcomm.dilocox")
# `agreed` when no state we hold is known agreed: no replay can start anywhere (a later check
# that agrees, or a download, sets it again)
NOTHING_AGREED = -(2 ** 31)


class PhiConsensus:
    """The consensus checks of our rounds, and the resyncs they bring."""

    def __init__(self, swarm: Swarm, replay: StepReplay, *,
                 finished: Callable[[int], set[str]], in_round: Callable[[int], set[str]],
                 pace: Callable[[], float], clock: Callable[[], float]):
        """`finished(k)`: the members that took part in round k and finished it (whose votes a
        check of round k + 1 can expect); `in_round(k)`: those still training round k (their
        vote of round k comes at its end); `pace()`: seconds one of our rounds takes (0 before
        we know)."""
        self.swarm, self.replay = swarm, replay
        self.finished, self.in_round, self.pace, self.clock = finished, in_round, pace, clock
        self.loop, self.transport, self.members = swarm.loop, swarm.transport, swarm.members
        self.peer_id, self.publish = swarm.peer_id, swarm.publish
        self.checks: dict[int, asyncio.Task] = {}  # checks in flight, by round
        self.resyncs: dict[int, Replay | Download] = {}  # by round: the repair of our φ
        self.agreed = -1  # the last round whose φ of ours a check found the majority's
        self.tied_round: int | None = None  # the last round whose tie we left for missing votes
        # our last finished check found our φ off the majority's: until one finds it agreed, a
        # round's end waits for the check in flight (`settle`), whose resync is due at that step
        self.diverged = False

    def restart_at(self, round_index: int, state_round: int | None = None) -> None:
        """We start `round_index` from the swarm's state (or the initial φ) of `state_round`
        (the round before, unless given): agreed."""
        self.agreed = round_index - 1 if state_round is None else state_round
        self.diverged = False

    def replay_failed(self, since: int, start: int | None) -> None:
        """The training thread's replay from our agreed state of round `since` did not give the
        majority's φ (a holder's records were wrong, or our φ of that round was not the
        majority's after all), or it holds no state of that round: replays start from round
        `start` from now on, the round of the agreed state it still holds (None: none, and the
        next divergent check downloads the state). A check that agreed since moved past it."""
        if self.agreed == since:
            self.agreed = NOTHING_AGREED if start is None else start

    def start(self, round_index: int, digest: str) -> None:
        check = self.swarm.tasks.spawn(self.check(round_index, digest),
                                       f"dilocox consensus of round {round_index}")
        self.checks[round_index] = check
        check.add_done_callback(lambda task: self.checks.get(round_index) is task
                                and self.checks.pop(round_index))

    async def check(self, round_index: int, digest: str) -> None:
        """Waits for the members that reach this round to announce their φ, then compares."""
        began = self.clock()
        while True:  # the votes are counted after every wait, the last one included
            votes, holders = self._votes(round_index, digest)
            complete = sum(votes.values()) > len(self.finished(round_index - 1))
            if complete or self._waited_enough(round_index, self.clock() - began):
                break  # everyone who could vote has voted, or we waited long enough
            self.members.want_fresh()  # votes arrive with the member cache
            await asyncio.sleep(self.members.refresh_s)
        majority = winning_digest(votes)
        if majority == digest:
            # agreed (another vote for our φ), or nothing known (no other vote came): either
            # way nothing to wait for at the next round's end
            self.diverged = self.diverged and 1 < sum(votes.values()) and votes[digest] < 2
            voters = max(sum(votes.values()), len(self.finished(round_index - 1)) + 1)
            if votes[digest] >= max(2, state_majority(voters)):
                self.agreed = max(self.agreed, round_index)
            return
        if not complete and votes[majority] <= votes[digest] and self.tied_round != round_index - 1:
            # A tie is broken only once every vote is in: a missing one may decide it. But a
            # vote missing round after round (a member whose announcements run ahead or lag)
            # would keep two survivors split forever, so a tie that lasts a second round is
            # broken with the votes that came; both sides see the same ones and pick alike.
            self.tied_round = round_index
            return
        if votes[majority] < 2 and sum(votes.values()) >= 3:
            # A tie of lone digests, which a liar would win by grinding a small one: the holder
            # ranked first for the round wins instead, so that members on lone digests converge
            # on one φ rather than each keeping its own
            majority = split_winner({digest: [self.peer_id], **holders}, round_index)
            if majority == digest:
                self.diverged = False
                return
        self.diverged = True
        self.publish(Diverged(round=round_index, ours=digest[:12], majority=majority[:12],
                              votes=dict(votes)))
        await self._resync(round_index, majority, holders.get(majority, []))

    def _votes(self, round_index: int, digest: str) -> tuple[Counter, dict[str, list[str]]]:
        """(votes by φ digest of round `round_index`, ours included; the members holding each)"""
        holders = phi_holders(self.members.eligible(), round_index)  # a banned peer has no say
        votes = Counter({digest: 1})
        votes.update({vote: len(peers) for vote, peers in holders.items()})
        return votes, holders

    def _waited_enough(self, round_index: int, waited_s: float) -> bool:
        """consensus_wait_s for the votes; as long as one of our rounds while members still
        train the round, whose votes come only at its end: a node ahead of its members by most
        of a round still compares its φ with theirs."""
        if waited_s < self.swarm.timeouts.consensus_wait_s:
            return False
        return waited_s >= self.pace() or not self.in_round(round_index)

    async def _resync(self, round_index: int, majority: str, holders: list[str]) -> None:
        """Our steps replayed over the majority's messages when our last agreed round is near,
        or else the majority's state downloaded from one of its `holders`."""
        if recipe := await self.replay.recipe(round_index, self.agreed, majority, holders):
            self.resyncs[round_index] = recipe
            return
        layout = self.swarm.state_layout
        if layout is None:
            return
        for first in range(len(holders)):  # a liar found, the next attempt starts at another holder
            order = holders[first:] + holders[:first]
            if self.swarm.bans.is_banned(order[0]):
                continue
            try:  # ranges from the holders in turn: one that breaks off is resumed at the next
                fetched = await fetch_state(self.transport, order, layout,
                                            phi_round=round_index, digest=majority,
                                            usable=lambda peer: not self.swarm.bans.is_banned(peer))
            except StateFetchFailed as exc:
                log.info("resync of round %d failed: %s", round_index, exc)
                return
            peer = fetched.sources[0]
            if fetched.meta.get("phi_round") == round_index and fetched.digest == majority:
                # the training thread checks it as a contribution of `source` before adopting it
                self.resyncs[round_index] = Download(round_index, fetched.groups["phi"],
                                                     fetched.groups["momentum"], peer)
                self.publish(ResyncReady(round=round_index, source=peer))
                return
            liar = fetched.served_phi_alone()
            if fetched.meta.get("phi_round") == round_index and liar is not None:
                # it announced one φ, served another
                self.swarm.bans.ban_now(liar, "resync_digest", f"{liar} served a φ of round "
                                        f"{round_index} with digest {fetched.digest[:12]}, where it "
                                        f"announced {majority[:12]}", self.transport.ban)

    async def settle(self, round_index: int, wait_s: float, pace: float) -> None:
        """Waits at most `wait_s` and one of our rounds (`pace`) for the check of the round
        before `round_index` while we are known to be off the majority's φ, or once a member's
        φ of that round was heard: its resync is due at this step, and a step taken on a φ the
        check is about to repair splits this round too (one that comes later is taken at the
        next, our step since replayed over it, never dropped). Not while no other vote came
        (nothing to compare yet), and never once the swarm is a round ahead: a check may wait
        for votes that never come (members rounds ahead announce other rounds), and a node
        that waits then falls further behind, its messages refused as stale and its φ off
        again: a node waits only while it is at most one round behind the majority's round."""
        check = self.checks.get(round_index - 1)
        members = self.members.eligible()
        if check is not None and pace > 0 and agreed_round(members) <= round_index + 1 \
                and (self.diverged or phi_holders(members, round_index - 1)):
            await asyncio.wait({check}, timeout=min(wait_s, pace))

    def pop_resync(self, round_index: int) -> Replay | Download | None:
        """The resync due at the outer step after `round_index`: of that round, or the latest of
        an earlier one whose step it came too late for (the training thread replays its own
        steps since over it); all are dropped. Its steps are recorded as ours, so that we serve
        them to others' replays."""
        due = [r for r in self.resyncs if r <= round_index]
        state = self.resyncs[max(due)] if due else None
        for old in due:
            del self.resyncs[old]
        if isinstance(state, Replay):  # our steps are the majority's now
            for step, target, senders in state.steps:
                self.replay.record(step, (target, senders))
        elif state is not None:  # a state downloaded whole: we do not know its step's messages
            self.replay.record(state.round, None)
        return state
