"""NoLoCo's end of a round in the training thread (docs/protocols.md §1; the math is protocol/noloco.py).

At the end of round r the node takes its snapshot S_r = (φ, Δ = θ − φ), encodes it as the
manifest's protocol.snapshot says (θ alone, the default, exact when β = γ; or φ and Δ: see
payload.py), hands it to its link (the daemon's exchange on the event loop, or the simulator's
in-memory link), and gets back at most one partner snapshot:
- `overlap` (default): the round ends with the local update, and the snapshot a partner swapped
  with us *during* round r (its round r−1, for our S_{r−1}) corrects φ, δ and θ at the first
  step boundary after it lands, as if that pair's update had been taken in time
  (protocol/noloco.py late_pair_correction); nothing waits on the network. On a slow link the
  swap may land rounds later (at most protocol.max_swap_rounds: node/rounds/noloco/pacing.py);
  the correction then uses our snapshot of that pair's round, kept until its swap ends;
- `blocking`: the link pairs and swaps S_r now, waiting at most `pair_deadline_s` for a partner;
  a swap under way ends by the transport's rules (p2p/progress.py), not by that wait.
Whatever arrives is checked before use: its layout (a snapshot of the other layout is refused),
its encoding (a quantized wire_dtype: exact tensors and byte lengths, valid scales and codes),
names, shapes, finite values, and a norm within max_norm_ratio of the node's own matching
tensors (θ against its θ; φ against its φ and Δ against its Δ). The alignment check
(min_alignment_sigmas) compares progress Δ only, so it needs "phi_delta"; the manifest refuses
it with "theta". So does the noise check (node/rounds/noise_check.py, noise_ratio): on θ alone,
θ_j − φ_i mixes the partner's honest φ_j − φ_i into a noise sender's Δ, and honest and noise
scores overlapped in simulation (benchmarks/NOTEBOOK.md); with "theta" it is not applied. A partner's θ is applied as the snapshot (θ, 0) (protocol/noloco.py
theta_only_snapshot), after the pull bound (protocol/pull_bound.py): a θ further from the node's
own than contributions.pull_clip_ratio times the median distance of its other recent partners is
clipped to that distance, and refused past pull_refuse_ratio times it, so that no pairing moves φ by more
than (β/2)·pull_clip_ratio of that median; the same rule judges the difference's part along the
node's own tensors (radial), against its own history. No partner, or a refused one, gives the local update of
G = {self}, counted.

A node more than max_staleness rounds behind its swarm (it started late, or stalled) or ahead of
it (it ran alone faster, through a cut link) could pair with nobody; at a round's end it moves to
the swarm's round (protocol/matching.py catch_up_round): its step counter and schedule move
forward or back, and its φ, δ, θ, inner optimizer and data position stay its own, for the pairs
to come to average. Except the first jump forward of its life: a node that far behind from the
start trained alone (a first look at the DHT that found nobody), so its weights are near its
initial ones; it adopts the swarm's state by the late-join quorum (node/daemon/state_quorum.py,
through its link), and keeps its own only when none is agreed. (A checkpoint saved after going back replaces those numbered above it:
node/train/checkpoint.py.)

What travels is encoded in node/rounds/noloco/payload.py.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from node.config.manifest import ContributionSection, ProtocolSection, check_snapshot
from node.events import PairCorrected
from node.rounds.contributions import ContributionRefused, check_contribution, global_norm
from node.rounds.noise_check import NoiseCheck
from node.rounds.noloco import payload
from node.rounds.policy import RoundOutcome
from node.rounds.wire_tensors import QUANTIZED_BITS, rounding_errors
from node.train.trainer import InnerTrainer
from protocol import pull_bound
from protocol.noloco import NoLoCo, NoLoCoHyperParameters, NoLoCoSnapshot, theta_only_snapshot
from protocol.tensors import shift_in_place, weights_digest


@dataclass
class PartnerSnapshot:
    peer: str
    round_index: int
    message: Any  # a received message holding the snapshot (payload.decode_snapshot reads it)
    pair_round: int | None = None  # overlap: our round the pair formed in (None: blocking)


class NoLoCoLink(Protocol):
    """The network's side, called from the training thread."""

    def partner_landed(self) -> bool:
        """Overlap: a partner snapshot is waiting to be taken (cheap, from any thread)."""

    def take_partner(self, round_index: int) -> PartnerSnapshot | None:
        """Overlap: a partner snapshot swapped with us during `round_index` or, landing late, up to
        max_swap_rounds before it (the oldest first), if any; each is taken once."""

    def pending_pair_rounds(self) -> set[int]:
        """Overlap: the rounds whose pairs may still land a partner snapshot."""

    def finish_round(self, round_index: int, snapshot: list, wait_s: float,
                     next_round: int | None = None) -> PartnerSnapshot | None:
        """Offers this round's snapshot to partners; blocking: returns the partner snapshot of
        this round (overlap: None, see take_partner). The next round is `next_round`
        (default round_index + 1)."""

    def catch_up_round(self, round_index: int) -> int | None:
        """The swarm's round if this node, ending `round_index`, is too far behind to pair."""

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        """Counts a refused contribution against `peer` (and may ban it)."""

    def swarm_state(self, reference: dict, from_round: int) -> Any:
        """The swarm's state (round_index, tensors {"phi", "momentum"}, meta) agreed by the
        late-join quorum, checked against `reference` (our φ); None if none was agreed."""


@dataclass(frozen=True)
class NoLoCoOutcome(RoundOutcome):
    partner: str | None           # whose snapshot this round applied
    partner_round: int | None     # the round of that snapshot
    local_update: bool            # no partner: G = {self}
    local_updates: int            # running totals
    partner_updates: int
    caught_up_to: int | None      # the swarm's round this node moved to (forward or back)
    pair_shift: float | None      # overlap: the norm of what the pair's correction added to θ
    pulls_clipped: int = 0        # running total: partner θs clipped to the pull bound

    @property
    def partners(self) -> list[str]:
        return [self.partner] if self.partner else []


@dataclass
class _Pair:
    """A partner snapshot taken in overlap timing, and what applying it did."""

    partner: PartnerSnapshot | None
    used: list[NoLoCoSnapshot]   # [its snapshot] if it passed the checks, else []
    refused: list[str]
    shift: float | None = None

    @staticmethod
    def of_round(pairs: list[_Pair]) -> _Pair:
        """The round's outcome: the last snapshot applied (if any), with every refusal."""
        used = [pair for pair in pairs if pair.used]
        last = used[-1] if used else _Pair(None, [], [])
        return _Pair(last.partner, last.used, [s for pair in pairs for s in pair.refused], last.shift)


def rounding_seed(seed: int, node: str) -> int:
    """The seed of `node`'s stochastic rounding: its own, and one run's the same every time."""
    return random.Random(f"{seed}:{node}:wire-rounding").getrandbits(63)


class NoLoCoRound:
    def __init__(self, config: ProtocolSection, contributions: ContributionSection,
                 trainer: InnerTrainer, link: NoLoCoLink, rounding_seed: int = 0):
        """`rounding_seed`: of this node's stochastic rounding (protocol.wire_rounding); nodes
        should differ, so that their rounding errors are independent."""
        check_snapshot(config, contributions)  # a manifest's rule, for sections built in code too
        self.config, self.contributions = config, contributions
        self.trainer, self.link = trainer, link
        hyper = NoLoCoHyperParameters(config.momentum, config.progress_weight,
                                      config.consensus_weight)
        # φ and δ live beside θ (on the GPU when it trains there): the round's end is then a few
        # elementwise passes on the device, and only the encoded snapshot crosses to the host
        self.device = trainer.device
        self.outer = NoLoCo({k: v.detach() for k, v in trainer.named_parameters().items()}, hyper)
        self.local_updates = 0
        self.partner_updates = 0
        self.lock = threading.Lock()  # held while φ changes; late-join exports take it too
        self.state_round, self.phi_digest = -1, weights_digest(self.outer.slow_weights)
        # overlap: what we offered, by the round whose pair swaps it (the next one), kept while
        # a pair of that round may still land
        self.offered: dict[int, NoLoCoSnapshot] = {}
        self._applied: list[_Pair] = []  # overlap: partner snapshots applied in this round
        # seconds of a mid-round correction, by part (PairCorrected): waiting on the event loop
        # (link.take_partner), decoding, the contribution checks, φ's digest
        self._held = dict.fromkeys(("wait", "decode", "check", "digest"), 0.0)
        self.noise_check = NoiseCheck(contributions.noise_ratio)
        self.pull_bound = pull_bound.PullBound(contributions.pull_clip_ratio,
                                               contributions.pull_refuse_ratio)
        self.radial_bound = pull_bound.PullBound(contributions.pull_clip_ratio,
                                                 contributions.pull_refuse_ratio)
        self.pulls_clipped = 0  # partner θs clipped to the pull bound (not refusals: no strike)
        self.caught_up = False  # moved to the swarm's round before (the first jump adopts its state)
        self.rounding = None  # rounding to nearest
        if config.wire_rounding == "stochastic" and config.wire_dtype in QUANTIZED_BITS:
            self.rounding = torch.Generator(device=self.device or "cpu").manual_seed(rounding_seed)

    def between_steps(self, round_index: int) -> PairCorrected | None:
        """Overlap: a partner snapshot that landed during the round corrects θ at this step
        boundary rather than at the round's end, so the rest of the round trains from where
        the pair's update puts the node (with a fast swap: exactly where blocking would). φ
        changed, so the event returned carries its new digest for late joiners to verify."""
        if self.config.timing != "overlap" or not self.link.partner_landed():
            return None
        before, started = self.phi_digest, time.monotonic()
        self._held = dict.fromkeys(self._held, 0.0)
        pairs = self._overlap_corrections(round_index, mid_round=True)
        self._applied += pairs
        used = [pair for pair in pairs if pair.used]
        if not used:
            return None
        return PairCorrected(round=self.state_round, phi_digest=self.phi_digest,
                             partner=used[-1].partner.peer, phi_before=before, shift=used[-1].shift,
                             seconds=time.monotonic() - started,
                             **{f"{part}_seconds": t for part, t in self._held.items()})

    def end_round(self, round_index: int) -> NoLoCoOutcome:
        next_round = self.link.catch_up_round(round_index)  # None: round_index + 1, as usual
        adopted = None  # the round of the swarm's state taken instead of our own
        if next_round is not None and next_round > round_index + 1 and not self.caught_up:
            next_round, adopted = self._take_swarm_state(round_index, next_round)
        self.caught_up = self.caught_up or next_round is not None
        if self.config.timing == "overlap":
            pairs, self._applied = self._applied + self._overlap_corrections(round_index), []
            own = self.outer.snapshot(self.trainer.named_parameters())
            encoded = self._encoded(own)  # before the clock: the wait is the network's alone
            waited = time.monotonic()
            self.link.finish_round(round_index, encoded, 0.0, next_round)
            waited = time.monotonic() - waited
            keep = self.link.pending_pair_rounds()
            with self.lock:  # the local update; the pair's comes next round
                phi = self.outer.outer_step(own) if adopted is None else self.outer.slow_weights
                self.state_round = round_index if adopted is None else adopted
                self.phi_digest = weights_digest(phi)
            pair_round = round_index + 1 if next_round is None else next_round
            self.offered = {r: s for r, s in self.offered.items() if r in keep}
            self.offered[pair_round] = own
            pair = _Pair.of_round(pairs)
        else:
            own = self.outer.snapshot(self.trainer.named_parameters())
            encoded = self._encoded(own)
            waited = time.monotonic()
            partner = self.link.finish_round(round_index, encoded, self.config.pair_deadline_s,
                                             next_round)
            waited = time.monotonic() - waited
            pair = self._checked(partner, own) if adopted is None else _Pair(None, [], [])
            with self.lock:
                phi = self.outer.outer_step(own, pair.used) if adopted is None \
                    else self.outer.slow_weights
                self.state_round = round_index if adopted is None else adopted
                self.phi_digest = weights_digest(phi)
        self.trainer.load_parameters(phi)
        if next_round is not None:
            self.trainer.start_at(next_round * self.config.inner_steps)
        if pair.used:
            self.partner_updates += 1
        else:
            self.local_updates += 1
        partner = pair.partner if pair.used else None
        return NoLoCoOutcome(
            phi_digest=self.phi_digest, refused=pair.refused, network_wait_seconds=waited,
            partner=partner.peer if partner else None,
            partner_round=partner.round_index if partner else None,
            local_update=not pair.used, local_updates=self.local_updates,
            partner_updates=self.partner_updates, caught_up_to=next_round, pair_shift=pair.shift,
            pulls_clipped=self.pulls_clipped)

    def _take_swarm_state(self, round_index: int, swarm_round: int) -> tuple[int, int | None]:
        """The first jump forward to the swarm's round: (the round to train next, the round of
        the swarm's state adopted in place of ours), or (`swarm_round`, None) keeping ours when
        the quorum agreed on none. Adopted, this round's own progress is dropped: the round
        offers the adopted φ (Δ = 0) and takes no outer step."""
        self.caught_up = True
        with self.lock:
            reference = {name: t.clone() for name, t in self.outer.slow_weights.items()}
        joined = self.link.swarm_state(reference, round_index + 1)
        if joined is None:
            return swarm_round, None
        self.adopt(joined.tensors)
        self._applied = []  # pairs formed on what we offered before cannot correct this
        return joined.round_index, int(joined.meta.get("phi_round", joined.round_index - 1))

    def _encoded(self, own: NoLoCoSnapshot) -> list:
        return payload.encode_snapshot(own, self.config.wire_dtype, self.config.snapshot,
                                       self.rounding)

    def _overlap_corrections(self, round_index: int, mid_round: bool = False) -> list[_Pair]:
        """Each pair that swapped one of our snapshots for a partner's and landed since the last
        call: apply that pair's update now, as a correction of φ, δ and θ (protocol/noloco.py),
        against the snapshot of ours it swapped. Mid-round, φ of `state_round` changes: what we
        serve, and its digest with it (at the round's end the local update follows, and its
        digest replaces both)."""
        pairs = []
        while (partner := self._take_partner(round_index)) is not None:
            own = self.offered.get(partner.pair_round)
            if own is None:  # we restarted or adopted a state since we offered it
                pairs.append(_Pair(partner, [], []))
                continue
            pair = self._checked(partner, own)
            if pair.used:
                with self.lock:
                    correction = self.outer.late_pair_correction(own, pair.used)
                    if mid_round:
                        digesting = time.monotonic()
                        self.phi_digest = weights_digest(self.outer.slow_weights)
                        self._held["digest"] += time.monotonic() - digesting
                shift_in_place(self.trainer.named_parameters(), correction)
                pair.shift = global_norm(correction)
            pairs.append(pair)
        return pairs

    def _take_partner(self, round_index: int) -> PartnerSnapshot | None:
        asked = time.monotonic()  # a call into the event loop: timed apart (PairCorrected)
        try:
            return self.link.take_partner(round_index)
        finally:
            self._held["wait"] += time.monotonic() - asked

    def _checked(self, partner: PartnerSnapshot | None, reference: NoLoCoSnapshot) -> _Pair:
        """The partner's snapshot, used if it passes the contribution checks (else counted)."""
        if partner is None:
            return _Pair(None, [], [])
        try:
            shapes = {name: tuple(t.shape) for name, t in reference.slow_weights.items()}
            decoding = time.monotonic()
            try:  # decoded where φ lies: on a GPU node the host's cores stay with training
                groups = payload.decode_snapshot(partner.message, self.config.snapshot, partner.peer,
                                                 self.config.wire_dtype, shapes, self.device)
            finally:
                checking = time.monotonic()
                self._held["decode"] += checking - decoding
            if self.config.snapshot == "theta":
                own_theta = reference.fast_weights()
                checks = [("fast weights", groups["theta"], own_theta, 0.0)]
            else:  # the alignment check compares progress only (node/rounds/contributions.py)
                checks = [("slow weights", groups["phi"], reference.slow_weights, 0.0),
                          ("progress", groups["delta"], reference.local_progress,
                           self.contributions.min_alignment_sigmas)]
            try:
                for what, theirs, mine, sigmas in checks:
                    check_contribution(partner.peer, theirs, mine, global_norm(mine),
                                       self.contributions.max_norm_ratio, f"NoLoCo {what}", sigmas)
                if self.config.snapshot == "theta" and self.pull_bound.enabled:
                    # the floors: our progress, plus what the wire alone puts between two θs
                    # (all of it, and its part along our own tensors)
                    wire = rounding_errors(own_theta, self.config.wire_dtype)
                    floors = (global_norm(reference.local_progress) + wire.norm,
                              pull_bound.radial(reference.slow_weights, own_theta) + wire.along)
                    groups["theta"] = self._bound_pull(partner.peer, groups["theta"], own_theta,
                                                       floors)
            finally:  # a norm is read on the host: the device's queue is drained by here
                self._held["check"] += time.monotonic() - checking
            if self.config.snapshot == "theta":
                snapshot = theta_only_snapshot(groups["theta"], self.outer.hyper)
            else:
                snapshot = NoLoCoSnapshot(groups["phi"], groups["delta"])
            if self.noise_check.enabled and self.config.snapshot != "theta":
                self.noise_check.check(partner.peer, groups["delta"], reference.local_progress,
                                       "NoLoCo snapshot")
            return _Pair(partner, [snapshot], [])
        except (ContributionRefused, ValueError) as exc:
            reason = getattr(exc, "reason", "malformed")
            self.link.refused(partner.peer, reason, str(exc))
            return _Pair(partner, [], [str(exc)])

    def _bound_pull(self, peer: str, theirs: dict, mine: dict,
                    floors: tuple[float, float]) -> dict:
        """The pull bound (protocol/pull_bound.py) on a partner's θ: `theirs`, or it clipped, or
        ContributionRefused("distance") past the refusal bound of either statistic; `floors`:
        f for the distance, f_ρ for the radial part."""
        by_distance = self.pull_bound.judge(peer, pull_bound.distance(theirs, mine), floors[0])
        verdict = by_distance
        if self.radial_bound.enabled:
            by_radial = self.radial_bound.judge(peer, pull_bound.radial(theirs, mine), floors[1])
            verdict = pull_bound.stricter(by_distance, by_radial)
        ratio, m = self.contributions.pull_refuse_ratio, verdict.reference
        if verdict.refused and verdict is by_distance:
            raise ContributionRefused(
                "distance", f"NoLoCo fast weights from {peer} lie {verdict.distance:.4g} from this "
                f"node's, more than {ratio:g}x the median distance of its recent partners "
                f"({m:.4g}, {peer}'s own left out); dropped")
        if verdict.refused:
            raise ContributionRefused(
                "distance", f"NoLoCo fast weights from {peer} differ from this node's by "
                f"{verdict.distance:.4g} along this node's own tensors (shrunk, grown, negated or "
                f"replaced), more than {ratio:g}x the median of its recent partners ({m:.4g}, "
                f"{peer}'s own left out); dropped")
        if verdict.scale < 1.0:
            self.pulls_clipped += 1
            return pull_bound.clip_towards(theirs, mine, verdict.scale)
        return theirs

    def export_state(self, round_index: int | None = None) -> tuple[int, dict, str]:
        """(round, {"phi": φ, "momentum": δ}, digest of φ) for a late joiner; any thread.
        NoLoCo members hold their own φ, so only the latest state is served."""
        with self.lock:
            return (self.state_round, {"phi": self.outer.slow_weights,
                                       "momentum": self.outer.outer_momentum}, self.phi_digest)

    def state_version(self, round_index: int | None = None) -> tuple[int, str]:
        with self.lock:
            return self.state_round, self.phi_digest

    def adopt(self, groups: dict, state_round: int | None = None) -> None:
        """A late joiner takes a member's φ and δ as its own, and θ = φ (`state_round`: for
        DiLoCoX's replays; NoLoCo keeps no history of its steps)."""
        with self.lock:
            self.outer.load_state_dict({"slow_weights": groups["phi"],
                                        "outer_momentum": groups["momentum"]})
            self.phi_digest = weights_digest(groups["phi"])
            self.offered = {}  # a pair formed on what we offered before cannot correct this
        self.trainer.load_parameters(groups["phi"])

    def state_dict(self) -> dict[str, Any]:
        return {"noloco": self.outer.state_dict(), "local_updates": self.local_updates,
                "partner_updates": self.partner_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["noloco"])
        self.local_updates = int(state["local_updates"])
        self.partner_updates = int(state["partner_updates"])
