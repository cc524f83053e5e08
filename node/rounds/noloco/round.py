"""NoLoCo's end of a round in the training thread (PROTOCOLS.md §1; the math is protocol/noloco.py).

At the end of round r the node takes its snapshot S_r = (φ, Δ = θ − φ), hands it to the exchange
(the event loop), and gets back at most one partner snapshot:
- `overlap` (default): the round ends with the local update, and the snapshot a partner swapped
  with us *during* round r (its round r−1, for our S_{r−1}) corrects φ, δ and θ at the next
  step boundary, as if that pair's update had been taken in time (protocol/noloco.py
  late_pair_correction); nothing waits on the network;
- `blocking`: the exchange pairs and swaps S_r now, waiting at most `pair_deadline_s`.
Whatever arrives is checked (names, shapes, finite, norm) before use; no partner, or a refused
one, gives the local update of G = {self}, counted.

A node more than max_staleness rounds behind its swarm (it started late, or stalled) could pair
with nobody; at a round's end it jumps to the swarm's round (protocol/matching.py
catch_up_round): its step counter and schedule move forward, and its φ, δ, θ, inner optimizer
and data position stay its own, for the pairs to come to average.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from node.rounds.contributions import ContributionRefused, check_contribution, global_norm
from node.train.trainer import InnerTrainer
from node.rounds.wire_tensors import from_wire, to_wire
from protocol.noloco import NoLoCo, NoLoCoHyperParameters, NoLoCoSnapshot
from protocol.tensors import shift_in_place, weights_digest

PHI, DELTA = "phi/", "delta/"


@dataclass
class PartnerSnapshot:
    peer: str
    round_index: int
    message: Any  # p2p ReceivedMessage with PHI and DELTA tensors


class NoLoCoLink(Protocol):
    """The event loop's side, called from the training thread."""

    def partner_landed(self) -> bool:
        """Overlap: a partner snapshot is waiting to be taken (cheap, from any thread)."""

    def take_partner(self, round_index: int) -> PartnerSnapshot | None:
        """Overlap: the partner snapshot swapped with us during `round_index`, if any."""

    def finish_round(self, round_index: int, snapshot: list, wait_s: float,
                     next_round: int | None = None) -> PartnerSnapshot | None:
        """Offers this round's snapshot to partners; blocking: returns the partner snapshot of
        this round (overlap: None, see take_partner). The next round is `next_round`
        (default round_index + 1)."""

    def catch_up_round(self, round_index: int) -> int | None:
        """The swarm's round if this node, ending `round_index`, is too far behind to pair."""

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        """Counts a refused contribution against `peer` (and may ban it)."""


def encode_snapshot(snapshot: NoLoCoSnapshot, wire_dtype: str) -> list:
    return (to_wire(snapshot.slow_weights, wire_dtype, PHI)
            + to_wire(snapshot.local_progress, wire_dtype, DELTA))


def decode_snapshot(message: Any) -> NoLoCoSnapshot:
    return NoLoCoSnapshot(slow_weights=from_wire(message, PHI),
                          local_progress=from_wire(message, DELTA))


class NoLoCoRound:
    def __init__(self, trainer: InnerTrainer, hyper: NoLoCoHyperParameters, link: NoLoCoLink,
                 inner_steps: int, wire_dtype: str, timing: str, pair_deadline_s: float,
                 max_norm_ratio: float, min_alignment_sigmas: float = 0.0):
        self.trainer, self.link, self.inner_steps = trainer, link, inner_steps
        self.outer = NoLoCo({k: v.detach() for k, v in trainer.named_parameters().items()}, hyper)
        self.wire_dtype, self.timing = wire_dtype, timing
        self.pair_deadline_s, self.max_norm_ratio = pair_deadline_s, max_norm_ratio
        self.min_alignment_sigmas = min_alignment_sigmas
        self.local_updates = 0
        self.partner_updates = 0
        self.lock = threading.Lock()  # held while φ changes; late-join exports take it too
        self.state_round, self.phi_digest = -1, weights_digest(self.outer.slow_weights)
        self.previous_own: NoLoCoSnapshot | None = None  # overlap: what we offered this round
        self._corrected: tuple[int, tuple] | None = None  # overlap: (round, correction result)

    def between_steps(self, round_index: int) -> dict[str, Any] | None:
        """Overlap: a partner snapshot that landed during the round corrects θ at this step
        boundary rather than at the round's end, so the rest of the round trains from where
        the pair's update puts the node (with a fast swap: exactly where blocking would). φ
        changed, so the event returned carries its new digest for late joiners to verify."""
        if self.timing != "overlap" or not self.link.partner_landed() \
                or (self._corrected is not None and self._corrected[0] == round_index):
            return None
        self._corrected = (round_index, self._overlap_correction(round_index, mid_round=True))
        partner, partners, _ = self._corrected[1]
        if not partners:
            return None
        return {"event": "pair_correction", "round": self.state_round,
                "phi_digest": self.phi_digest, "partner": partner.peer}

    def end_round(self, round_index: int) -> dict[str, Any]:
        next_round = self.link.catch_up_round(round_index)  # None: round_index + 1, as usual
        if self.timing == "overlap":
            if self._corrected is not None and self._corrected[0] == round_index:
                partner, partners, refused = self._corrected[1]
            else:
                partner, partners, refused = self._overlap_correction(round_index)
            own = self.outer.snapshot(self.trainer.named_parameters())
            waited = time.monotonic()
            self.link.finish_round(round_index, encode_snapshot(own, self.wire_dtype), 0.0, next_round)
            waited = time.monotonic() - waited
            with self.lock:
                phi = self.outer.outer_step(own)  # the local update; the pair's comes next round
                self.state_round, self.phi_digest = round_index, weights_digest(phi)
            self.previous_own = own
        else:
            own = self.outer.snapshot(self.trainer.named_parameters())
            waited = time.monotonic()
            partner = self.link.finish_round(round_index, encode_snapshot(own, self.wire_dtype),
                                             self.pair_deadline_s, next_round)
            waited = time.monotonic() - waited
            partners, refused = self._checked(partner, own)
            with self.lock:
                phi = self.outer.outer_step(own, partners)
                self.state_round, self.phi_digest = round_index, weights_digest(phi)
        self.trainer.load_parameters(phi)
        if next_round is not None:
            self.trainer.start_at(next_round * self.inner_steps)
        if partners:
            self.partner_updates += 1
        else:
            self.local_updates += 1
        return {"partner": partner.peer if partners else None,
                "partner_round": partner.round_index if partners else None,
                "local_update": not partners, "refused": refused,
                "phi_digest": self.phi_digest, "network_wait_seconds": waited,
                "local_updates": self.local_updates, "partner_updates": self.partner_updates,
                "caught_up_to": next_round}

    def _overlap_correction(self, round_index: int, mid_round: bool = False
                            ) -> tuple[PartnerSnapshot | None, list, str | None]:
        """The pair formed during this round swapped our previous snapshot for the partner's:
        apply that pair's update now, as a correction of φ, δ and θ (protocol/noloco.py).
        Mid-round, φ of `state_round` changes: what we serve, and its digest with it (at the
        round's end the local update follows, and its digest replaces both)."""
        partner = self.link.take_partner(round_index)
        if partner is None or self.previous_own is None:
            return partner, [], None  # nothing swapped, or we restarted since we offered it
        partners, refused = self._checked(partner, self.previous_own)
        if partners:
            with self.lock:
                correction = self.outer.late_pair_correction(self.previous_own, partners)
                if mid_round:
                    self.phi_digest = weights_digest(self.outer.slow_weights)
            shift_in_place(self.trainer.named_parameters(), correction)
        return partner, partners, refused

    def _checked(self, partner: PartnerSnapshot | None,
                 reference: NoLoCoSnapshot) -> tuple[list[NoLoCoSnapshot], str | None]:
        """[the partner's snapshot] if it passes the contribution checks, else [] (counted)."""
        if partner is None:
            return [], None
        try:
            snapshot = decode_snapshot(partner.message)
            for what, theirs, mine in (("slow weights", snapshot.slow_weights, reference.slow_weights),
                                       ("progress", snapshot.local_progress, reference.local_progress)):
                check_contribution(partner.peer, theirs, mine, global_norm(mine),
                                   self.max_norm_ratio, f"NoLoCo {what}", self.min_alignment_sigmas)
            return [snapshot], None
        except (ContributionRefused, ValueError) as exc:
            reason = getattr(exc, "reason", "malformed")
            self.link.refused(partner.peer, reason, str(exc))
            return [], str(exc)

    def export_state(self, round_index: int | None = None) -> tuple[int, dict, str]:
        """(round, {"phi": φ, "momentum": δ}, digest of φ) for a late joiner; any thread.
        NoLoCo members hold their own φ, so only the latest state is served."""
        with self.lock:
            return (self.state_round, {"phi": self.outer.slow_weights,
                                       "momentum": self.outer.outer_momentum}, self.phi_digest)

    def adopt(self, groups: dict) -> None:
        """A late joiner takes a member's φ and δ as its own, and θ = φ."""
        with self.lock:
            self.outer.load_state_dict({"slow_weights": groups["phi"],
                                        "outer_momentum": groups["momentum"]})
            self.phi_digest = weights_digest(groups["phi"])
            self.previous_own = None  # a pair formed on what we offered before cannot correct this
        self.trainer.load_parameters(groups["phi"])

    def state_dict(self) -> dict[str, Any]:
        return {"noloco": self.outer.state_dict(), "local_updates": self.local_updates,
                "partner_updates": self.partner_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["noloco"])
        self.local_updates = int(state["local_updates"])
        self.partner_updates = int(state["partner_updates"])
