"""NoLoCo over the swarm, the event loop's side (docs/protocols.md §1 "asynchronous random matching").

Pairs form by signed one-way control messages (propose / accept / decline) driven by the pure
state machine in protocol/matching.py; a formed pair swaps snapshots over one full-duplex signed
stream, opened by the pair's initiator (the lower peer id). The training thread calls
`finish_round` once per round (the `NoLoCoLink` of node/rounds/noloco/round.py):
- overlap: returns the partner snapshot swapped during the round at once, offers the new one;
- blocking: offers the new snapshot, pairs and swaps it now, waiting at most `pair_deadline_s`
  for a partner, and for a swap under way until it ends.

Invariants:
- at most one pair per round (protocol/matching.py I1); a snapshot is swapped only with the
  peer the matching paired us with for the current round, anything else is refused;
- the loop never waits on the training thread, and `finish_round` never waits on the network in
  overlap timing;
- a failed swap leaves the round unpaired: the worker does a local update, counted; a swap
  that outlasts its round is applied when it lands, up to `max_swap_rounds` rounds later (its
  need-by: p2p/progress.py ends a swap that stalls or could not land by then, never one that
  keeps moving in time)
  (older: dropped, counted), and a node whose swaps outlast its rounds pairs less often
  (node/rounds/noloco/pacing.py, the `SwapPacer` fed here), resting in between;
- a pair the partner does not hold (it cancelled our accept, or refused our swap as not paired:
  protocol/matching.py I6) is dropped at once, and the node looks for another partner.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import threading
from contextlib import suppress

from node.config.manifest import ProtocolSection
from node.events import (CaughtUp, NoPartner, PairCancelled, Paired, PairingPaced, Rested,
                         SwapFailed, SwapLate, Swapped)
from node.rounds.noloco.pacing import SwapPacer
from node.rounds.noloco.round import PartnerSnapshot
from node.rounds.state import StateLayout, round_bound, settled
from node.rounds.state_fetch import download_bound_s
from node.rounds.swarm import Swarm, failure_sentence, peer_name
from p2p.errors import P2PError, Reason, Refusal, RemoteRefused
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.progress import NeedBy
from p2p.wire import MessageHeader
from protocol.matching import (DeclineReason, MatchingState, MatchMessage, MessageKind, Pair,
                               ReadyAnnouncement, catch_up_round)

log = logging.getLogger("lowcomm.noloco")
MATCH, SNAPSHOT = "noloco.match", "noloco.snapshot"
# Overlap timing proposes at a random moment in the first part of the round. Proposing the
# instant a round ends would meet peers still finishing the previous round, already paired:
# they decline, pairs form in finishing order, and with steady node speeds never change.
PROPOSAL_WINDOW = 0.6
# While this node wants a partner it looks for newly ready peers this often (the member
# cache refreshes every 0.5 s); blocking timing waits on it at every round's end.
MATCH_POLL_S = 0.25
# Overlap timing, until the proposal window closes, a node does not propose to its last round's
# partner (see `_announcements`).


class NoLoCoExchange:
    def __init__(self, config: ProtocolSection, swarm: Swarm, rng: random.Random):
        self.swarm, self.rng = swarm, rng
        self.loop, self.transport, self.membership = swarm.loop, swarm.transport, swarm.members
        self.peer_id, self.manifest, self.publish = swarm.peer_id, swarm.manifest, swarm.publish
        self.timing = config.timing
        self.control_timeout_s = swarm.timeouts.match_message_s
        self.matching = MatchingState(self.peer_id, self.manifest, 0, config.max_staleness,
                                      admitted=self.membership.admitted)
        self.offered: OutgoingMessage | None = None
        self.accepting = self.timing == "overlap"  # blocking: only while waiting at a round's end
        self.partners: dict[int, PartnerSnapshot] = {}
        self.landed = threading.Event()  # a partner snapshot waits: read by the training thread
        self.changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.propose_after = 0.0
        # how many rounds after its pair's a snapshot is still applied (blocking: none, the
        # round's end has passed)
        self.max_late = config.max_swap_rounds if self.timing == "overlap" else 0
        self.pacer = SwapPacer(config.max_swap_rounds)
        # pairs whose partner snapshot has not landed yet: (partner, our round) -> when formed
        self.open_pairs: dict[tuple[str, int], float] = {}
        self.recent_pairs: list[Pair] = []  # pairs of the last max_late rounds, oldest first
        self.dropped_pair = None  # the last half-formed pair dropped (I6)
        self.last_partner: str | None = None
        self.window_closes = 0.0
        self._settling: list[tuple[str, asyncio.Future]] = []  # swaps waiting on our proposal
        self.failed_round: int | None = None  # blocking: this round's swap failed, stop waiting
        self._round_started = self.loop.time()
        self.round_seconds = 0.0
        # where a member's claimed round is checked against: this node's round and clock when it
        # started (the clock from now, so that waiting for peers counts: they train meanwhile)
        self.started_round, self.started_at = 0, self.loop.time()
        self._implausible: set[str] = set()  # members whose round was left out, logged once each

    # ------------------------------------------------------------------ life
    def start(self, round_index: int) -> None:
        self.started_round, self._round_started = round_index, self.loop.time()
        self.matching = MatchingState(self.peer_id, self.manifest, round_index,
                                      self.matching.max_staleness, admitted=self.membership.admitted)
        accept_any = lambda _round: True  # the matching checks rounds itself (staleness)
        self.transport.on_push(MATCH, self._on_match, accept_round=accept_any)
        # counted_reply: a NOT_PAIRED refusal counts in the node's refused metrics
        self.transport.on_swap(SNAPSHOT, self.transport.counters.counted_reply(self._snapshot_reply),
                               accept_round=accept_any,
                               deliver=self._snapshot_delivered, accept_bytes=self._snapshot_size)
        self._task = self.swarm.tasks.spawn(self._matchmaker(), "noloco matchmaker")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ------------------------------------------------------------------ training thread side
    def partner_landed(self) -> bool:
        return self.landed.is_set()

    def take_partner(self, round_index: int) -> PartnerSnapshot | None:
        """Overlap: the oldest partner snapshot landed for a pair of `round_index` or before
        (a swap that outlasted its round), if any; each is taken once."""
        def take() -> PartnerSnapshot | None:
            landed = [r for r in self.partners if r <= round_index]
            snapshot = self.partners.pop(min(landed)) if landed else None
            if not self.partners:
                self.landed.clear()
            return snapshot
        return self.swarm.bridge.call("the partner snapshot", take)

    def pending_pair_rounds(self) -> set[int]:
        """Overlap: the rounds whose pairs may still land a snapshot (the round keeps our own
        snapshot of those rounds to apply them against)."""
        return self.swarm.bridge.call("the pairs in flight", lambda: (
            {r for _, r in self.open_pairs} | set(self.partners)))

    def finish_round(self, round_index: int, snapshot: list, wait_s: float,
                     next_round: int | None = None) -> PartnerSnapshot | None:
        return self.swarm.bridge.call(
            "the end of a NoLoCo round", self._finish_round, round_index, snapshot, wait_s,
            round_index + 1 if next_round is None else next_round,
            # blocking: a swap under way outlasts wait_s, bounded by its own progress
            wait_s=None if self.timing == "blocking" else wait_s)

    def catch_up_round(self, round_index: int) -> int | None:
        """The swarm's round, if this node (ending `round_index`) fell too far behind it or ran
        too far ahead of it to pair (protocol/matching.py catch_up_round); None otherwise.

        A node ahead goes back only with no pair in flight: pairs and landed snapshots are kept
        by round, and one of a round it would leave would land as if from the future."""
        def decide() -> int | None:
            rounds = self._plausible_rounds()
            swarm_round = catch_up_round(round_index + 1, rounds, self.matching.max_staleness)
            if swarm_round is not None and swarm_round <= round_index \
                    and (self.open_pairs or self.partners):
                return None
            return swarm_round
        return self.swarm.bridge.call("the swarm's round", decide)

    def swarm_state(self, reference: dict, from_round: int):
        """The swarm's state by the late-join quorum (node/daemon/state_quorum.py), for a node
        whose catch-up jump leaves its own weights behind; None when none was agreed in time
        (it then keeps its own, as before). `reference`: our φ, what a state is checked against."""
        if self.swarm.adopt_state is None:
            return None
        timeouts = self.swarm.timeouts  # what the quorum's downloads may take, at the slowest link
        budget = timeouts.state_download_attempts * download_bound_s(StateLayout.of(reference),
                                                                     self.swarm.transfer_limits) \
            + timeouts.state_announce_wait_s

        async def take():
            try:
                joined = await asyncio.wait_for(self.swarm.adopt_state(reference), timeout=budget)
            except Exception as exc:  # no state agreed, a download failed: keep our own
                log.warning("could not take the swarm's state on catching up: %s",
                            failure_sentence(exc))
                return None
            if joined is not None:
                self.publish(CaughtUp(source=joined.source, from_round=from_round,
                                      round=joined.round_index,
                                      state_round=joined.meta.get("phi_round"),
                                      digest=joined.meta.get("phi")))
            return joined
        return self.swarm.bridge.call("the swarm's state", take, wait_s=budget)

    def _plausible_rounds(self) -> list[int]:
        """The members' rounds, less any past what this node could have seen pass: at most
        `round_bound` of the rounds it could have trained since it started, at its fastest
        round. With one peer in view the swarm's round is that peer's, and a member claiming
        round 10^6 moved an honest node there (its step schedule over at once, CI)."""
        now = self.loop.time()
        fastest = min([*self.pacer.round_seconds, now - self._round_started])
        ceiling = self.started_round + round_bound((now - self.started_at) / max(fastest, 1e-3))
        rounds = []
        for rec in settled(self.membership.eligible()):  # a member still joining has no round
            if rec.round <= ceiling:
                rounds.append(rec.round)
            elif rec.peer_id not in self._implausible:
                self._implausible.add(rec.peer_id)
                log.warning("member %s claims round %d, more than this node could have seen pass "
                            "since it started at round %d (at most %d): left out of the swarm's "
                            "round", rec.peer_id, rec.round, self.started_round, ceiling)
        return rounds

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        self.swarm.refuse_from_thread(peer, reason, sentence)

    async def _finish_round(self, round_index: int, snapshot: list, wait_s: float, next_round: int):
        message = OutgoingMessage(SNAPSHOT, round_index, snapshot)
        if self.timing == "overlap":
            self.offered = message  # what partners of the next round get
            self._next_round(next_round)
            return None
        # blocking: pair and swap this very snapshot, up to the deadline; peers propose only to
        # members announced ready, so announce it now (the first round would otherwise wait
        # the whole deadline alone)
        self.offered, self.accepting = message, True
        self.membership.update(round=round_index, status="ready")
        self.changed.set()
        await self._wait_partner(round_index, wait_s)
        self.accepting = False
        partner = self.partners.pop(round_index, None)
        self._next_round(next_round)
        return partner

    async def _wait_partner(self, round_index: int, wait_s: float) -> None:
        """Blocking: waits up to `wait_s` for a partner of `round_index`; a swap under way then
        is waited for until it lands or fails (p2p/progress.py ends it if it stalls or cannot
        finish in time), never cut by the partner wait."""
        give_up_at = self.loop.time() + wait_s
        while round_index not in self.partners and self.failed_round != round_index:
            swapping, now = self._swapping(round_index), self.loop.time()
            if not swapping and now >= give_up_at:
                self.publish(NoPartner(round=round_index, waited_s=wait_s))
                return
            self.changed.clear()
            with suppress(asyncio.TimeoutError):  # a swap's progress sets no event: look again
                await asyncio.wait_for(self.changed.wait(), MATCH_POLL_S if swapping else give_up_at - now)

    def _swapping(self, round_index: int) -> bool:
        """A swap of a pair of `round_index` is under way: ours (the initiator's task holds the
        pair open until it ends), or the partner's, arriving."""
        return any(p.round_index == round_index and (p.partner, round_index) in self.open_pairs
                   and (p.initiator == self.peer_id or self.transport.receiving(p.partner, SNAPSHOT))
                   for p in self.recent_pairs)

    def _swap_need_by(self, round_index: int) -> NeedBy | None:
        """Overlap: the swap of a pair of `round_index` is of use until the end of round
        `round_index + max_swap_rounds` (later it is dropped as late): that many of our longest
        recent rounds, less what has passed of the current one. None (the transport's default,
        what the bytes take at the swarm's minimum link rate) before a round was measured, and
        in blocking timing, where the node waits for the swap."""
        if self.timing != "overlap" or not self.pacer.round_seconds:
            return None
        longest = max(self.pacer.round_seconds)
        rounds_left = round_index + self.max_late + 1 - self.matching.round_index
        seconds = rounds_left * longest - (self.loop.time() - self._round_started)
        return NeedBy(max(seconds, longest), f"the {self.max_late} rounds it may outlast its own "
                      f"by ({max(seconds, longest):.0f} s at {longest:.0f} s a round)")

    def _next_round(self, next_round: int) -> None:
        now = self.loop.time()
        self.round_seconds, self._round_started = now - self._round_started, now
        if self.timing == "overlap":
            self.propose_after = now + self.rng.uniform(0, PROPOSAL_WINDOW * self.round_seconds)
            self.window_closes = now + PROPOSAL_WINDOW * self.round_seconds
        outcome = self.matching.end_round(next_round)
        self.last_partner = outcome.pair.partner if outcome.pair else None
        for message in outcome.outgoing:
            self._send_control(message)
        self._wake_settled()
        oldest = next_round - self.max_late  # a pair older than this can no longer land
        # above next_round only after going back to the swarm's round (catch_up_round), in the
        # rare race with a pair formed meanwhile: such a pair is given up, not kept for later
        self.partners = {r: p for r, p in self.partners.items() if oldest <= r <= next_round}
        # pairs are remembered one round longer, so that a snapshot landing just too late is
        # counted late (SwapLate), not dropped unseen
        self.open_pairs = {key: t for key, t in self.open_pairs.items()
                           if oldest - 1 <= key[1] <= next_round}
        self.recent_pairs = [p for p in self.recent_pairs
                             if oldest - 1 <= p.round_index <= next_round]
        if not self.partners:
            self.landed.clear()
        if self.timing == "overlap":
            self.accepting = self._pace(next_round)
        # overlap: ready all round with the snapshot just offered (unless resting); blocking:
        # ready only while waiting at the round's end (a training node cannot accept)
        ready = self.offered is not None and self.timing == "overlap" and self.accepting
        self.membership.update(round=next_round, status="ready" if ready else "training")
        self.changed.set()

    def _pace(self, next_round: int) -> bool:
        """Whether this node pairs in `next_round` (node/rounds/noloco/pacing.py); says so when
        its interval changes, and for every round it rests."""
        self.pacer.record_round(self.round_seconds)
        before = self.pacer.interval
        interval = self.pacer.update()
        if interval != before:
            swaps, rounds = self.pacer.swap_seconds, self.pacer.round_seconds
            self.publish(PairingPaced(round=next_round, interval=interval,
                                      swap_seconds=sorted(swaps)[len(swaps) // 2],
                                      round_seconds=sorted(rounds)[len(rounds) // 2]))
        self._judge_link(next_round)
        pairs = self.pacer.pairs_in(next_round, swap_in_flight=bool(self.open_pairs))
        if not pairs:
            self.publish(Rested(round=next_round, interval=interval))
        return pairs

    def _judge_link(self, next_round: int) -> None:
        """The link, judged from the swaps the pacer measured (node/rounds/link_watch.py)."""
        swaps, rounds = self.pacer.swap_seconds, self.pacer.round_seconds
        if self.swarm.link_watch is not None and swaps and rounds and self.offered is not None:
            self.swarm.link_watch.observe(next_round, moved_bytes=self.offered.total_bytes,
                                          seconds=statistics.median(swaps),
                                          round_seconds=statistics.median(rounds), members=2,
                                          what="swaps")

    # ------------------------------------------------------------------ matching
    def _announcements(self) -> list[ReadyAnnouncement]:
        """Unpaired peers: a member announces "ready" while it may pair and "exchanging" once
        paired, so a proposal rarely meets a decline. Every eligible round counts the same
        (docs/protocols.md §1): preferring peers of our own round made nodes of equal speed pair only
        with each other, and a swarm of two fast and two slow nodes split into two pairs that
        never mixed (measured: tests/integration/test_swarm.py, 2 distinct pairs in 10 rounds)."""
        ready = [ReadyAnnouncement(rec.peer_id, rec.manifest, rec.round)
                 for rec in self.membership.eligible() if rec.status == "ready"]
        if self.loop.time() < self.window_closes:
            # A node pairs early in its round, so the peers free then are those whose rounds
            # start with ours: nodes of equal speed lock in phase, and uniform draws among them
            # kept the same two pairs round after round (4 nodes: 2 distinct pairs in 10
            # rounds). Passing over the last partner until the window closes mixes the phases.
            ready = [a for a in ready if a.peer_id != self.last_partner]
        return ready

    async def _matchmaker(self) -> None:
        """Proposes whenever this node may pair and has no partner and no proposal in flight."""
        while True:
            wait = 1.0  # membership changes arrive by the cache's refresh: look again soon
            if self.accepting and self.offered is not None and self.matching.wants_partner:
                wait = MATCH_POLL_S  # a partner may have just become ready: every poll counts
                self.membership.want_fresh()
                early = self.propose_after - self.loop.time()
                if early > 0:
                    wait = min(wait, early)
                else:
                    proposal = self.matching.choose_candidate(self._announcements(), self.rng)
                    if proposal is not None:
                        self._send_control(proposal)
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass

    def _send_control(self, message: MatchMessage) -> None:
        meta = {"k": message.kind.value, "pr": message.proposal_round, "sr": message.sender_round,
                "why": message.reason.name if message.reason else ""}
        outgoing = OutgoingMessage(MATCH, message.proposal_round, (), meta)

        async def send() -> None:
            try:
                await self.transport.push(message.recipient, outgoing, need_by=NeedBy(
                    self.control_timeout_s, f"the {self.control_timeout_s:.0f} s a matching message may "
                    f"take (node.match_message_s)"))
            except P2PError as exc:
                log.info("match %s to %s failed: %s", message.kind.value, message.recipient[-8:], exc)
                if message.kind is MessageKind.PROPOSE:  # an unreachable peer is a decline
                    self._handle(MatchMessage(MessageKind.DECLINE, message.recipient, self.peer_id,
                                              message.proposal_round, message.sender_round,
                                              self.manifest, DeclineReason.BUSY))
        self.swarm.tasks.spawn(send(), f"noloco {message.kind.value} to {message.recipient[-8:]}")

    async def _on_match(self, received: ReceivedMessage) -> None:
        meta = received.meta
        try:
            kind = MessageKind(meta["k"])
            reason = DeclineReason[meta["why"]] if meta.get("why") else None
            message = MatchMessage(kind, peer_name(received.sender), self.peer_id, int(meta["pr"]),
                                   int(meta["sr"]), received.header.manifest, reason)
        except (KeyError, ValueError, TypeError):
            raise Refusal(Reason.MALFORMED, "a match message needs k, pr, sr and why") from None
        if kind is MessageKind.PROPOSE and not (self.accepting and self.offered is not None):
            self._send_control(MatchMessage(MessageKind.DECLINE, self.peer_id, message.sender,
                                            message.proposal_round, self.matching.round_index,
                                            self.manifest, DeclineReason.BUSY))
            return
        self._handle(message)

    def _handle(self, message: MatchMessage) -> None:
        had_pair = self.matching.pair
        for reply in self.matching.handle(message):
            self._send_control(reply)
        pair = self.matching.pair
        if had_pair is not None and pair is None:
            self._pair_dropped(had_pair, "the partner cancelled its proposal")
        elif pair is not None and had_pair is None:
            self.open_pairs[(pair.partner, pair.round_index)] = self.loop.time()
            self.recent_pairs.append(pair)
            self.pacer.paired(pair.round_index)
            self.publish(Paired(round=pair.round_index, partner=pair.partner))
            self.membership.update(status="exchanging")  # no more proposals this round
            if pair.initiator == self.peer_id:
                self.swarm.tasks.spawn(self._swap(pair), f"noloco swap with {pair.partner[-8:]}",
                                      transfer=True)
        self._wake_settled()
        self.changed.set()

    def _pair_dropped(self, pair: Pair, why: str) -> None:
        """A half-formed pair is gone (I6): free to pair again in this round."""
        self.dropped_pair = pair
        self.open_pairs.pop((pair.partner, pair.round_index), None)
        self.recent_pairs = [p for p in self.recent_pairs if p is not pair]
        self.publish(PairCancelled(round=pair.round_index, partner=pair.partner, why=why))
        self.membership.update(status="ready" if self.accepting and self.offered else "training")
        self.changed.set()

    # ------------------------------------------------------------------ swapping snapshots
    async def _swap(self, pair: Pair) -> None:
        offered, partner, round_index = self.offered, pair.partner, pair.round_index
        try:
            received = await self.transport.swap(partner, offered, need_by=self._swap_need_by(round_index),
                                                 expected_reply_bytes=offered.total_bytes,
                                                 accept_bytes=self._snapshot_size)
        except Exception as exc:  # whatever broke it, a failed swap is counted and logged once
            self._swap_ended(partner, round_index)
            if isinstance(exc, RemoteRefused) and exc.reason is Reason.NOT_PAIRED:
                if self.matching.pair is pair and self.matching.drop_pair(partner):
                    self._pair_dropped(pair, "the partner refused our swap as not paired")
                if pair is self.dropped_pair:  # half-formed (here or by its cancel): no swap owed
                    return
            self.publish(SwapFailed(round=round_index, partner=partner, error=failure_sentence(exc)))
            self.failed_round = round_index  # one pair a round: blocking need not wait on
            self.changed.set()
            return
        self._store(partner, round_index, received)

    async def _snapshot_reply(self, header: MessageHeader) -> OutgoingMessage:
        """Our latest snapshot, for this round's partner, or last round's: a pair formed just
        before our round ended still serves the partner, whose round it belongs to."""
        sender = peer_name(header.sender)
        if self._pair_with(sender) is None and self.matching.outstanding == sender:
            # The peer accepted our proposal and, as initiator, opened the swap at once: its
            # accept travels on another stream and may land after the swap does (measured:
            # 8 ms later, which refused the swap and left both waiting the whole deadline).
            await self._proposal_settled(sender)
        if self._pair_with(sender) is None or self.offered is None:
            raise Refusal(Reason.NOT_PAIRED, "not paired with you this round")
        return self.offered

    def _snapshot_size(self, declared: int) -> bool:
        """A partner's snapshot has exactly our own's bytes: same manifest (snapshot layout, wire
        dtype), same model. Any other declared size is refused before a byte of it is read."""
        return self.offered is None or declared == self.offered.total_bytes  # None: NOT_PAIRED

    def _pair_with(self, peer: str) -> Pair | None:
        """Our pair with `peer` whose snapshot is still to come, the oldest first (a swap may
        outlast its round: the pair of an earlier round may still be swapping), else our latest
        pair with it (its snapshot may be delivered before our reply to the same swap is asked
        for), else None."""
        waiting = self._open_pair_with(peer)
        if waiting is not None:
            return waiting
        return next((p for p in reversed(self.recent_pairs) if p.partner == peer), None)

    def _open_pair_with(self, peer: str) -> Pair | None:
        """Our oldest pair with `peer` whose snapshot is still to come, else None."""
        return next((p for p in self.recent_pairs
                     if p.partner == peer and (peer, p.round_index) in self.open_pairs), None)

    async def _proposal_settled(self, peer: str) -> None:
        """Waits, at most the match message timeout, until our proposal to `peer` is answered."""
        settled = self.loop.create_future()
        self._settling.append((peer, settled))
        try:
            await asyncio.wait_for(asyncio.shield(settled), timeout=self.control_timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._settling.remove((peer, settled))

    def _wake_settled(self) -> None:
        for peer, settled in self._settling:
            if self.matching.outstanding != peer and not settled.done():
                settled.set_result(None)

    async def _snapshot_delivered(self, received: ReceivedMessage) -> None:
        """The initiator's snapshot, for our oldest pair with it still waiting for one (formed in
        an earlier round, it may land late: applied up to max_late rounds after, else counted
        late, never dropped unseen). A second snapshot for a pair that has one is ignored."""
        sender = peer_name(received.sender)
        if self._open_pair_with(sender) is None and self.matching.outstanding == sender:
            # As in `_snapshot_reply`: the initiator's accept may land after its snapshot (CI: a
            # 122 kB snapshot arrived 5 ms before the accept, was dropped, and the round waited
            # its whole 60 s pair deadline for it; again in a later round, where the closed
            # pair of an earlier round with the same peer hid the missing one)
            await self._proposal_settled(sender)
        pair = self._pair_with(sender)
        if pair is not None and (sender, pair.round_index) in self.open_pairs:
            self._store(sender, pair.round_index, received)

    def _swap_ended(self, partner: str, round_index: int) -> None:
        """A swap of ours ended, landed or not: how long it took is what the pacer measures."""
        formed = self.open_pairs.pop((partner, round_index), None)
        if formed is not None:
            self.pacer.record_swap(self.loop.time() - formed)

    def _store(self, partner: str, round_index: int, received: ReceivedMessage) -> None:
        self._swap_ended(partner, round_index)
        if round_index < self.matching.round_index - self.max_late:  # too late to use
            self.publish(SwapLate(round=round_index, partner=partner))
            return
        self.partners[round_index] = PartnerSnapshot(partner, received.round, received,
                                                     pair_round=round_index)
        self.landed.set()
        self.publish(Swapped(round=round_index, partner=partner, partner_round=received.round,
                             bytes=len(received.payload)))
        self.changed.set()
