"""How far one NoLoCo pairing may pull a node: a bound on a partner's θ (docs/protocols.md §1).

With β = γ a partner j enters node i's outer step only through θ_j (protocol/noloco.py
theta_only_snapshot): a pair's update moves φ_i by (β/2)·(θ_j − θ_i) beyond the local update
(0.35·(θ_j − θ_i) at the defaults). A partner that sends any θ_j of a plausible norm (random
weights, −θ, θ plus a push towards a model of its choosing) therefore moves φ_i as far as it
likes. The rule, per node i and partner snapshot θ_j, with d = ‖θ_j − θ_i‖ (θ_i: the node's own
θ of the pair's round):

    m = max(f, median of the last `window` distances this node accepted)   (the median once
        `warmup` were accepted; before that, and as a floor, f alone)
    f = ‖Δ_i‖ + e_i: the node's own progress ‖θ_i − φ_i‖ (what two honest replicas of one φ
        differ by after a round) plus e_i, how far its θ_i would arrive from itself over the
        wire (the rounding of protocol.wire_dtype: node/rounds/wire_tensors.py
        rounding_error_norm; with int4 it outweighs a round's progress many times)
    d > refuse_ratio·m:  refused (the caller counts it against the partner: strikes, bans);
    d > clip_ratio·m:    clipped, θ_j ← θ_i + (clip_ratio·m / d)·(θ_j − θ_i);
    else:                used as sent;

and an accepted d (clipped or not, unclipped value) joins the history. So one pairing moves
φ_i by at most (β/2)·clip_ratio·m beyond its local update, whatever the partner sends; a
minority of the node's partners cannot move the median m, and a node whose honest partners all
lie further away (it was cut off, or it is the outlier) takes them at the clipped distance until
they fill half its window and m follows them. Honest distances measured against m, and the
harm of each adversary with and without the rule: benchmarks/RESULTS.md ("A bound on a
partner's θ"). `clip_ratio` = 0 turns the rule off.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

WINDOW = 16   # accepted distances remembered: the node's recent honest partners
WARMUP = 4    # accepted distances before their median counts


def distance(theirs: Mapping[str, torch.Tensor], mine: Mapping[str, torch.Tensor]) -> float:
    """‖theirs − mine‖ over all tensors (same names), one tensor's difference at a time."""
    total = 0.0
    for name, t in theirs.items():
        total += float((t.detach().float() - mine[name].detach().float()).pow(2).sum())
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

    distance: float
    reference: float   # m
    scale: float
    refused: bool


@dataclass
class PullBound:
    """One node's rule and its history of accepted distances (see the module docstring)."""

    clip_ratio: float
    refuse_ratio: float
    window: int = WINDOW
    warmup: int = WARMUP
    accepted: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.accepted = deque(self.accepted, maxlen=self.window)

    @property
    def enabled(self) -> bool:
        return self.clip_ratio > 0

    def reference(self, floor: float) -> float:
        """m: the median accepted distance once `warmup` were accepted, at least `floor` (f)."""
        if len(self.accepted) < self.warmup:
            return floor
        return max(floor, statistics.median(self.accepted))

    def judge(self, partner_distance: float, floor: float) -> PullVerdict:
        """The verdict on a partner at `partner_distance`, with f = `floor`; an accepted one
        joins the history."""
        m = self.reference(floor)
        if m <= 0:  # no progress and no history (nothing trained yet): nothing to measure by
            return PullVerdict(partner_distance, m, 1.0, False)
        if partner_distance > self.refuse_ratio * m:
            return PullVerdict(partner_distance, m, 0.0, True)
        self.accepted.append(partner_distance)
        limit = self.clip_ratio * m
        scale = 1.0 if partner_distance <= limit else limit / partner_distance
        return PullVerdict(partner_distance, m, scale, False)
