"""NoLoCo's asynchronous random matching (docs/protocols.md §1), as a pure per-node state machine.

Volunteers share no clock, so pairs form by proposals: a node that completed a round announces
itself "ready" (`ReadyAnnouncement`); an unpaired node picks a uniformly random eligible peer
and proposes; the peer accepts unless it is already paired for its current round, else it
declines and the proposer tries another. This module decides; it never sends. Every handler
returns the `MatchMessage`s to send, and the driver (the simulator in node/simulator/, the
network daemon later) delivers them however it likes, in any order, with any delay.

Eligibility of a peer for a node: another node (never itself), the same swarm manifest digest,
and |their round − my round| <= max_staleness (default 2).

The one subtle case is a node with a proposal of its own in flight that receives another
proposal. Accepting it could pair the node twice (its own target may accept too), so it:
- pairs at once if the proposal comes from its own target (simultaneous proposals between the
  same two nodes make ONE pair: both sides see the other's proposal and pair);
- defers the proposal if the proposer's id is greater than its own, and answers it when its own
  proposal is answered (declined: accept the lowest deferred id; accepted: decline them all);
- declines it otherwise ("busy").
Tie-break: whoever proposed, the pair's `initiator` (the side that opens the snapshot stream)
is the lower id, so both sides agree on it without knowing whose proposal won.

Deferrals only ever make a node wait on a node with a smaller id, so chains of waiting are
strictly decreasing in id and cannot close into a cycle: no deadlock, every proposal gets an
answer (without message loss) while both nodes stay in their round. Without the deferral, three
nodes proposing round a cycle (A→B, B→C, C→A) would all decline each other and nobody would pair.

The other subtle case is an accept that arrives after its proposer gave the proposal up (its
round ended, or the proposal's delivery timed out although it arrived). The acceptor holds a
pair the proposer does not; nothing would ever be swapped, and the acceptor would wait out its
round unpaired (measured in a 20-minute soak: 5 of 695 pairs). So the proposer answers such an
accept with a CANCEL naming the proposal, and the acceptor drops the pair and may pair again.

Invariants (checked by tests/unit/test_matching.py):
  I1 a node holds at most one partner per round; once set it changes only at `end_round`, or is
     dropped by a cancel (I6);
  I2 the partner is never the node itself and was eligible when the pair formed (an accept
     from an ineligible peer counts as its decline);
  I3 at most one own proposal is in flight, and each peer is proposed to at most once a round,
     so a round sends at most (eligible peers) proposals and proposing always terminates;
  I4 a node with a proposal in flight never accepts anyone but its own target, so a pair seen
     by one side is the same pair on the other side (A has partner B  =>  B has partner A);
  I5 replies are matched to the proposal they answer by the proposer's round: a reply from an
     earlier round, or from a peer that was not proposed to, is ignored and counted, and so is
     a repeated proposal from a peer already waiting for an answer;
  I6 an accept its proposer cannot use, from a peer it is not paired with, is answered with a
     CANCEL of that proposal; a cancel drops the acceptor's pair only if that pair came from
     that very proposal (the latest one it accepted from the partner), so a stale cancel never
     undoes a pair both sides hold.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from protocol.errors import ConfigurationError, ProtocolError

DEFAULT_MAX_STALENESS = 2


class MessageKind(enum.Enum):
    PROPOSE = "propose"
    ACCEPT = "accept"
    DECLINE = "decline"
    CANCEL = "cancel"  # the proposer gave the proposal up before the accept arrived (I6)


class DeclineReason(enum.Enum):
    PAIRED = "already paired this round"
    BUSY = "own proposal in flight"
    INELIGIBLE = "not eligible (manifest or staleness)"
    ROUND_ENDED = "round ended before an answer"


@dataclass(frozen=True)
class ReadyAnnouncement:
    """What a node publishes when it completes a round: who, on which manifest, which round."""

    peer_id: str
    manifest_digest: str
    round_index: int


@dataclass(frozen=True)
class MatchMessage:
    """A control message of the matching. `proposal_round` is the proposer's round the message
    belongs to (I5); `sender_round` is the sender's own round (for the staleness check)."""

    kind: MessageKind
    sender: str
    recipient: str
    proposal_round: int
    sender_round: int
    manifest_digest: str
    reason: DeclineReason | None = None


@dataclass(frozen=True)
class Pair:
    """A formed pair as one side sees it. `initiator` opens the snapshot stream."""

    round_index: int      # this node's round
    partner: str
    partner_round: int
    initiator: str  # the lower of the two ids, on both sides


@dataclass
class MatchingCounters:
    proposals_sent: int = 0
    declines_received: int = 0
    declines_sent: int = 0
    deferred: int = 0
    ignored: int = 0
    cancels_sent: int = 0
    pairs_cancelled: int = 0
    rounds_paired: int = 0
    rounds_unpaired: int = 0


@dataclass(frozen=True)
class RoundOutcome:
    """What `end_round` reports: the pair of the finished round (None: a local update) and the
    declines owed to proposals still deferred."""

    round_index: int
    pair: Pair | None
    outgoing: tuple[MatchMessage, ...] = ()


@dataclass
class _Deferred:
    proposer: str
    proposer_round: int


def is_eligible(node_id: str, manifest_digest: str, round_index: int, peer_id: str,
                peer_manifest: str, peer_round: int, max_staleness: int) -> bool:
    """The eligibility rule of docs/protocols.md §1, in one place for proposer and acceptor."""
    return (peer_id != node_id and peer_manifest == manifest_digest
            and abs(peer_round - round_index) <= max_staleness)


def catch_up_round(next_round: int, peer_rounds: Iterable[int], max_staleness: int) -> int | None:
    """The round a node out of step with its swarm continues from, or None to go on as it is.

    Rounds are each node's own count, so a node that started late (a first node waiting for
    peers that began without it) or stalled for a while stays that far behind at equal speeds:
    more than `max_staleness` behind, it is eligible for nobody and trains alone for good
    (measured: a 20-minute soak whose first node started 15 rounds behind paired in 0 of 792
    rounds). A node that ran ahead is as alone: one that trained through a cut link without
    the cost of swaps came back 3 or more rounds ahead of the two others and paired in none of
    its next 50 rounds (a CI run of tests/integration/test_fault_points.py's cut link).

    The swarm's round is the upper median of all the rounds, this node's next one included:

        swarm = sorted(peer_rounds + [next_round])[n // 2],   n = the number of rounds

    and a node more than `max_staleness` from it moves to it, forward or back. The median,
    not the maximum, so that one fast node, or one lying about its round, cannot pull the
    others along; every node computes it from the same rounds, so two nodes apart never swap
    places (the upper median: with two nodes the one behind moves, as a late starter should).
    For a node below every peer it is the lower median of its peers' rounds, as it always was.
    """
    rounds = sorted([*peer_rounds, next_round])
    if len(rounds) == 1:
        return None
    swarm = rounds[len(rounds) // 2]
    return swarm if abs(swarm - next_round) > max_staleness else None


@dataclass
class MatchingState:
    """One node's matching for its current round. Pure: decisions only, no I/O, no clock.

    Round use: `choose_candidate(announcements, rng)` returns a PROPOSE to send (or None when no
    eligible peer is left); feed every received message to `handle(message)` and send what it
    returns; when `wants_partner` is true again (a decline), call `choose_candidate` again;
    finally `end_round()` gives the round's pair and moves to the next round.
    """

    node_id: str
    manifest_digest: str
    round_index: int = 0
    max_staleness: int = DEFAULT_MAX_STALENESS
    counters: MatchingCounters = field(default_factory=MatchingCounters)
    # The node's own word on who may be a partner beyond the rule (its newcomer gate,
    # node/daemon/newcomers.py): None admits everyone the rule does.
    admitted: Callable[[str], bool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ConfigurationError("matching node_id must be a non-empty string.")
        if type(self.max_staleness) is not int or self.max_staleness < 0:
            raise ConfigurationError(
                f"matching max_staleness must be an int >= 0, got {self.max_staleness!r}.")
        if type(self.round_index) is not int or self.round_index < 0:
            raise ConfigurationError(f"matching round must be an int >= 0, got {self.round_index!r}.")
        self._reset()

    def _reset(self) -> None:
        self.pair: Pair | None = None
        self.outstanding: str | None = None        # the peer our one proposal in flight went to
        self._accepted_proposal: int | None = None  # the partner's proposal our pair came from (I6)
        self._proposed: set[str] = set()           # peers proposed to this round (I3)
        self._deferred: list[_Deferred] = []

    # ------------------------------------------------------------------ queries
    @property
    def wants_partner(self) -> bool:
        """Unpaired and no proposal in flight: time to `choose_candidate`."""
        return self.pair is None and self.outstanding is None

    def eligible(self, peer_id: str, peer_manifest: str, peer_round: int) -> bool:
        return is_eligible(self.node_id, self.manifest_digest, self.round_index, peer_id,
                           peer_manifest, peer_round, self.max_staleness) \
            and (self.admitted is None or self.admitted(peer_id))

    def candidates(self, announcements: Iterable[ReadyAnnouncement]) -> list[str]:
        """Eligible peers not yet proposed to this round, sorted (so the draw does not depend
        on the order the announcements arrived in)."""
        return sorted({a.peer_id for a in announcements
                       if self.eligible(a.peer_id, a.manifest_digest, a.round_index)
                       and a.peer_id not in self._proposed})

    # ------------------------------------------------------------------ proposing
    def choose_candidate(self, announcements: Iterable[ReadyAnnouncement],
                         rng: random.Random) -> MatchMessage | None:
        """A PROPOSE to a uniformly random candidate, or None if paired, waiting, or no one is left."""
        if not self.wants_partner:
            return None
        candidates = self.candidates(announcements)
        if not candidates:
            return None
        target = candidates[rng.randrange(len(candidates))]
        self.outstanding = target
        self._proposed.add(target)
        self.counters.proposals_sent += 1
        return self._message(MessageKind.PROPOSE, target, self.round_index)

    # ------------------------------------------------------------------ receiving
    def handle(self, message: MatchMessage) -> list[MatchMessage]:
        """React to one received message; returns the messages to send in answer."""
        if message.recipient != self.node_id:
            raise ProtocolError(f"message for {message.recipient!r} was handed to {self.node_id!r}.")
        if message.kind is MessageKind.PROPOSE:
            return self._on_proposal(message)
        if message.kind is MessageKind.CANCEL:
            return self._on_cancel(message)
        if message.proposal_round != self.round_index or message.sender != self.outstanding:
            paired_with_sender = self.pair is not None and self.pair.partner == message.sender
            if message.kind is MessageKind.ACCEPT and paired_with_sender \
                    and message.proposal_round == self.round_index:
                return []  # its accept of a proposal that crossed ours: the pair stands
            self.counters.ignored += 1  # I5: an old or unsolicited reply
            if message.kind is MessageKind.ACCEPT and not paired_with_sender:
                self.counters.cancels_sent += 1  # I6: the sender holds a pair we do not
                return [self._message(MessageKind.CANCEL, message.sender, message.proposal_round)]
            return []
        if message.kind is MessageKind.ACCEPT:
            return self._on_accept(message)
        return self._on_decline(message)

    def _on_proposal(self, proposal: MatchMessage) -> list[MatchMessage]:
        proposer, their_round = proposal.sender, proposal.sender_round
        if not self.eligible(proposer, proposal.manifest_digest, their_round):
            return [self._decline(proposer, their_round, DeclineReason.INELIGIBLE)]
        if self.pair is not None:
            if self.pair.partner == proposer:  # its proposal crossed ours, already paired: agree
                self._accepted_proposal = their_round  # a cancel of an older one is stale (I6)
                return [self._message(MessageKind.ACCEPT, proposer, their_round)]
            return [self._decline(proposer, their_round, DeclineReason.PAIRED)]
        if self.outstanding is None:
            self._form_pair(proposer, their_round, accepted_proposal=their_round)
            return [self._message(MessageKind.ACCEPT, proposer, their_round)]
        if self.outstanding == proposer:  # simultaneous proposals: one pair, not two
            self._form_pair(proposer, their_round, accepted_proposal=their_round)
            self.outstanding = None
            return [self._message(MessageKind.ACCEPT, proposer, their_round),
                    *self._decline_deferred(DeclineReason.PAIRED)]
        if proposer > self.node_id:  # wait on a smaller id only: no cycle of waiting
            if any(d.proposer == proposer for d in self._deferred):
                self.counters.ignored += 1  # a repeated proposal: already waiting for an answer
                return []
            self._deferred.append(_Deferred(proposer, their_round))
            self.counters.deferred += 1
            return []
        return [self._decline(proposer, their_round, DeclineReason.BUSY)]

    def _on_accept(self, reply: MatchMessage) -> list[MatchMessage]:
        if not self.eligible(reply.sender, reply.manifest_digest, reply.sender_round):
            self.counters.ignored += 1  # an accept that breaks the rule (I2) counts as a decline
            return self._on_decline(reply)
        self.outstanding = None
        self._form_pair(reply.sender, reply.sender_round)
        return self._decline_deferred(DeclineReason.PAIRED)

    def _on_decline(self, reply: MatchMessage) -> list[MatchMessage]:
        self.outstanding = None
        self.counters.declines_received += 1
        if not self._deferred:
            return []  # wants_partner is true again: the driver calls choose_candidate
        first = min(self._deferred, key=lambda d: d.proposer)
        self._deferred.remove(first)
        self._form_pair(first.proposer, first.proposer_round, accepted_proposal=first.proposer_round)
        return [self._message(MessageKind.ACCEPT, first.proposer, first.proposer_round),
                *self._decline_deferred(DeclineReason.PAIRED)]

    def _on_cancel(self, cancel: MatchMessage) -> list[MatchMessage]:
        if (self.pair is None or self.pair.partner != cancel.sender
                or self._accepted_proposal != cancel.proposal_round):
            self.counters.ignored += 1  # a stale cancel: the pair stands (I6)
            return []
        self._drop_pair()
        return []

    def drop_pair(self, partner: str) -> bool:
        """The partner said it holds no pair with us (it refused our snapshot swap as not
        paired): the pair is half-formed, so drop it and be free to pair again this round.
        Returns whether a pair with `partner` was dropped."""
        if self.pair is None or self.pair.partner != partner:
            return False
        self._drop_pair()
        return True

    def _drop_pair(self) -> None:
        self.pair, self._accepted_proposal = None, None
        self.counters.pairs_cancelled += 1

    # ------------------------------------------------------------------ ending the round
    def end_round(self, next_round: int | None = None) -> RoundOutcome:
        """Close this round (its pair, or None for a local update) and start `next_round`
        (default: the next one). Deferred proposals are declined; a proposal still in flight is
        abandoned, and its late reply will be ignored (I5).

        `next_round` is lower only for a node that ran ahead of its swarm and goes back to its
        round (`catch_up_round`); a reply from the round it left could match one of that round
        come again only if it arrived rounds late, so the driver goes back with no pair open."""
        following = self.round_index + 1 if next_round is None else next_round
        if type(following) is not int or following == self.round_index or following < 0:
            raise ProtocolError(f"matching round must change: {self.round_index} -> {following!r}.")
        outgoing = tuple(self._decline_deferred(DeclineReason.ROUND_ENDED))
        if self.pair is None:
            self.counters.rounds_unpaired += 1
        else:
            self.counters.rounds_paired += 1
        outcome = RoundOutcome(self.round_index, self.pair, outgoing)
        self.round_index = following
        self._reset()
        return outcome

    # ------------------------------------------------------------------ helpers
    def _form_pair(self, partner: str, partner_round: int,
                   accepted_proposal: int | None = None) -> None:
        if self.pair is not None:  # I1, guarded: a bug here must not pass silently
            raise ProtocolError(f"{self.node_id!r} is already paired with {self.pair.partner!r} "
                                f"in round {self.round_index}.")
        self.pair = Pair(self.round_index, partner, partner_round, min(self.node_id, partner))
        self._accepted_proposal = accepted_proposal

    def _decline_deferred(self, reason: DeclineReason) -> list[MatchMessage]:
        declines = [self._decline(d.proposer, d.proposer_round, reason) for d in self._deferred]
        self._deferred = []
        return declines

    def _decline(self, recipient: str, proposal_round: int, reason: DeclineReason) -> MatchMessage:
        self.counters.declines_sent += 1
        return self._message(MessageKind.DECLINE, recipient, proposal_round, reason)

    def _message(self, kind: MessageKind, recipient: str, proposal_round: int,
                 reason: DeclineReason | None = None) -> MatchMessage:
        return MatchMessage(kind, self.node_id, recipient, proposal_round, self.round_index,
                            self.manifest_digest, reason)


def match_round(states: dict[str, MatchingState], announcements: list[ReadyAnnouncement],
                rng: random.Random, deliver_order: random.Random | None = None) -> dict[str, Pair | None]:
    """Run one round of matching to quiescence over a lossless, instant transport (the
    simulator's, and the reference for tests). Every unpaired node proposes in the same wave,
    so simultaneous and crossing proposals do happen; `deliver_order` shuffles each wave's
    delivery (default: the order sent). Returns each node's pair; does not call `end_round`."""
    in_flight: list[MatchMessage] = []
    while True:
        for node_id in sorted(states):
            proposal = states[node_id].choose_candidate(announcements, rng)
            if proposal is not None:
                in_flight.append(proposal)
        if not in_flight:
            return {node_id: state.pair for node_id, state in states.items()}
        if deliver_order is not None:
            deliver_order.shuffle(in_flight)
        wave, in_flight = in_flight, []
        for message in wave:
            recipient = states.get(message.recipient)
            if recipient is not None:  # a peer that left: its messages vanish
                in_flight.extend(recipient.handle(message))
