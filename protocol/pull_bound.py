"""How far one NoLoCo pairing may pull a node: a bound on a partner's θ (docs/protocols.md §1).

With β = γ a partner j enters node i's outer step only through θ_j (protocol/noloco.py
theta_only_snapshot): a pair's update moves φ_i by (β/2)·(θ_j − θ_i) beyond the local update
(0.35·(θ_j − θ_i) at the defaults). A partner that sends any θ_j of a plausible norm (random
weights, −θ, θ plus a push towards a model of its choosing) therefore moves φ_i as far as it
likes. The rule, per node i and partner j's snapshot θ_j, with d_j = ‖θ_j − θ_i‖ (θ_i: the
node's own θ of the pair's round):

    m_j = max(f, lower median of {D_k : k ≠ j})   (once at least `warmup` partners other than j
        are in the history; before that m_j = f)
    D_k = the latest distance judged for partner k, for the `window` partners judged most
        recently (every judged distance is recorded, refused and clipped ones too, unclipped)
    f = ‖Δ_i‖ + e_i: the node's own progress ‖θ_i − φ_i‖ (what two honest replicas of one φ
        differ by after a round) plus e_i, how far its θ_i would arrive from itself over the
        wire (the rounding of protocol.wire_dtype: node/rounds/wire_tensors.py
        rounding_error_norm; with int4 it outweighs a round's progress many times)
    d_j > refuse_ratio·m_j:  refused (the caller counts it against the partner: strikes, bans),
                             only while m_j comes from the other partners (warmup reached);
    d_j > clip_ratio·m_j:    clipped, θ_j ← θ_i + (clip_ratio·m_j / d_j)·(θ_j − θ_i);
    else:                    used as sent.

The same rule judges a second statistic, with its own history and floor: the radial part
ρ_j = ‖r‖, r_t = ⟨θ_j,t − θ_i,t, θ_i,t⟩ / ‖θ_i,t‖ for each tensor t (how far θ_j moves each of
the node's tensors along itself: shrinking, growing, negating, replacing it), with floor
f_ρ = ρ(θ_i against φ_i) + e_ρ, the node's own progress along its tensors plus the rounding's
part along them (rounding_error_along: about e_i/√(elements a tensor), since the rounding is
independent between elements). Two honest θs of one model differ along their own tensors by
little, and the wire's rounding adds almost nothing there, so ρ tells −θ (ρ = 2‖θ_i‖), random
weights of θ's norm (ρ ≈ ‖θ_i‖) or a zeroed tensor from an honest partner where d cannot:
with int4 θ, e_i is 0.05-0.5 of ‖θ_i‖, and those lie within a few f. A partner is refused if
either statistic refuses it and scaled by the smaller of the two scales (`stricter`).

On the floor alone (fewer than `warmup` other partners: a swarm of two or three, or a node's
first pairings) a partner is clipped, never refused: f is the node's own progress, not a
measured honest distance, and an honest partner paired across rounds or from a φ that drifted
lies several f away (a two-node swarm whose clocks differ by 60 s: 5.2 f); refusing it would
strike and ban the only partner on one node's estimate. The pull stays bounded by
(β/2)·clip_ratio·f.

Invariants: partner j's own distances never enter m_j, so nothing j sends moves the reference
it is judged by; each partner holds one entry of the history, whatever it sends and how often.
So a node's recent partners that lie further than every honest one leave every m_j at most the
largest honest distance while they are fewer than the honest ones (the lower median takes the
smaller middle entry), and any partners, nearer or further, leave every m_j within the honest
partners' distances (or at f) while the honest ones outnumber them by two; f keeps m_j from
falling below what two honest θs differ by. One pairing moves φ_i by at most
(β/2)·clip_ratio·m_j beyond its local update, whatever the partner sends. A node whose honest
partners all lie further away (it was cut off, or it is the outlier) takes them at the clipped
distance, and m_j follows them as their entries replace the history's. Honest distances measured
against m, and the harm of each adversary with and without the rule: benchmarks/RESULTS.md
("What does an adversary cost the honest members?"). `clip_ratio` = 0 turns the rule off.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch

WINDOW = 16   # partners whose latest distance is remembered: the node's recent partners
WARMUP = 2    # partners other than the judged one before their median counts


def distance(theirs: Mapping[str, torch.Tensor], mine: Mapping[str, torch.Tensor]) -> float:
    """‖theirs − mine‖ over all tensors (same names), one tensor's difference at a time."""
    total = 0.0
    for name, t in theirs.items():
        total += float((t.detach().float() - mine[name].detach().float()).pow(2).sum())
    return math.sqrt(total)


def radial(theirs: Mapping[str, torch.Tensor], mine: Mapping[str, torch.Tensor]) -> float:
    """ρ = ‖r‖, r_t = ⟨theirs_t − mine_t, mine_t⟩ / ‖mine_t‖ over tensors t (same names; a tensor
    of zeros in `mine` counts none): the difference's part along each of mine's tensors."""
    total = 0.0
    for name, t in theirs.items():
        own = mine[name].detach().float()
        norm = float(own.norm())
        if norm > 0.0:
            total += (float(((t.detach().float() - own) * own).sum()) / norm) ** 2
    return math.sqrt(total)


def clip_towards(theirs: Mapping[str, torch.Tensor], mine: Mapping[str, torch.Tensor],
                 scale: float) -> dict[str, torch.Tensor]:
    """mine + scale·(theirs − mine), tensor by tensor, in theirs' dtype and device (new tensors:
    a received tensor may be a read-only view of the wire's bytes)."""
    return {name: torch.lerp(t.detach(), mine[name].detach().to(device=t.device, dtype=t.dtype),
                             1.0 - scale) for name, t in theirs.items()}


@dataclass(frozen=True)
class PullVerdict:
    """What to do with one partner θ: `refused`, else use it scaled by `scale` (1: as sent)."""

    distance: float    # the statistic judged: d, or ρ for the radial part
    reference: float   # m
    scale: float
    refused: bool


def stricter(a: PullVerdict, b: PullVerdict) -> PullVerdict:
    """Of two verdicts on one θ, the one that refuses, else the one that scales it more."""
    if a.refused or b.refused:
        return a if a.refused else b
    return a if a.scale <= b.scale else b


@dataclass
class PullBound:
    """One node's rule and its history: the latest judged distance of each of its `window` most
    recently judged partners (see the module docstring)."""

    clip_ratio: float
    refuse_ratio: float
    window: int = WINDOW
    warmup: int = WARMUP
    latest: OrderedDict = field(default_factory=OrderedDict)  # partner -> D_k, oldest first

    @property
    def enabled(self) -> bool:
        return self.clip_ratio > 0

    def measured(self, partner: Hashable) -> bool:
        """Whether `warmup` partners other than `partner` are in the history: m_j then comes
        from their distances, not from f alone."""
        return len(self.latest) - (partner in self.latest) >= self.warmup

    def reference(self, partner: Hashable, floor: float) -> float:
        """m_j for `partner` j: the lower median of the other partners' latest distances once
        `warmup` others are known, at least `floor` (f)."""
        if not self.measured(partner):
            return floor
        others = [d for k, d in self.latest.items() if k != partner]
        return max(floor, statistics.median_low(others))

    def judge(self, partner: Hashable, partner_distance: float, floor: float) -> PullVerdict:
        """The verdict on `partner` at `partner_distance`, with f = `floor`; the distance
        becomes that partner's entry of the history whatever the verdict."""
        m, measured = self.reference(partner, floor), self.measured(partner)
        self._record(partner, partner_distance)
        if m <= 0:  # no progress and no history (nothing trained yet): nothing to measure by
            return PullVerdict(partner_distance, m, 1.0, False)
        if measured and partner_distance > self.refuse_ratio * m:
            return PullVerdict(partner_distance, m, 0.0, True)
        limit = self.clip_ratio * m
        scale = 1.0 if partner_distance <= limit else limit / partner_distance
        return PullVerdict(partner_distance, m, scale, False)

    def _record(self, partner: Hashable, partner_distance: float) -> None:
        self.latest.pop(partner, None)
        self.latest[partner] = partner_distance
        while len(self.latest) > self.window:
            self.latest.popitem(last=False)
