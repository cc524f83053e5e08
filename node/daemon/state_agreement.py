"""NoLoCo's choice among members' states: the one a majority agrees with (the rule and its
reasons: node/daemon/state_quorum.py). Pure functions of the candidates: each a state seen
whole (its tensors) or through its sketch (node/rounds/state_fetch.py StateSketch), the
distances and norms then estimated from the sketches' values."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from node.rounds.contributions import global_norm
from node.rounds.state import majority
from node.rounds.state_fetch import StateSketch

# NoLoCo: honest members' φ measured at most 0.17 apart (RMS distance to their mean over the
# mean's norm, benchmarks/NOTEBOOK.md "scale", 64 replicas), about 0.24 between two of them:
# states closer than 0.35 of φ's norm agree; a fourfold of the closest pair's distance, when
# three or more states are compared, widens it for a swarm spread wider than measured.
SPREAD_TOLERANCE = 0.35
FAR_FACTOR = 4.0


@dataclass
class _Candidate:
    source: str
    groups: dict[str, dict[str, torch.Tensor]]  # {} for a state seen only through its sketch
    digest: str
    meta: dict
    phi_server: str | None = None  # the member that served all of φ; None: several did
    sketch: StateSketch | None = None
    bytes_fetched: int = 0
    sources: tuple[str, ...] = ()


def _state_round(candidate: _Candidate) -> int:
    value = candidate.meta.get("phi_round")
    return value if type(value) is int else -1


def _distance(a: _Candidate, b: _Candidate) -> float:
    """Between two states' φ: estimated from their sketches (of one seed) when they have them."""
    if a.sketch is not None and b.sketch is not None:
        return a.sketch.phi_distance(b.sketch)
    x, y = a.groups["phi"], b.groups["phi"]
    return math.sqrt(sum(float((x[n].double() - y[n].double()).square().sum()) for n in x))


def _phi_norm(candidate: _Candidate) -> float:
    return candidate.sketch.phi_norm() if candidate.sketch is not None else global_norm(candidate.groups["phi"])


def _phi_scale(candidates: list[_Candidate]) -> float:
    """The median φ norm of the states: what distances between them are measured against."""
    return statistics.median(_phi_norm(c) for c in candidates) or 1.0


def _spread(candidates: list[_Candidate]) -> float:
    """The closest two states' distance over `_phi_scale` (what `choose_agreed` compares)."""
    return min(_distance(a, b) for i, a in enumerate(candidates)
               for b in candidates[i + 1:]) / _phi_scale(candidates)


def choose_agreed(candidates: list[_Candidate]) -> tuple[_Candidate | None, list[tuple[_Candidate, float]]]:
    """NoLoCo: (the state a majority of `candidates` agrees with, or None; [(far state, its
    distance over φ's norm)]). See the module's docstring for the rule."""
    count = len(candidates)
    if count == 1:
        return candidates[0], []
    distances = [[_distance(a, b) for b in candidates] for a in candidates]
    scale = _phi_scale(candidates)
    closest = min(distances[i][j] for i in range(count) for j in range(i + 1, count))
    tolerance = max(SPREAD_TOLERANCE * scale, FAR_FACTOR * closest if count >= 3 else 0.0)
    support = [sum(d <= tolerance for d in row) for row in distances]
    best = min(range(count), key=lambda i: (-support[i], sum(distances[i]), candidates[i].digest))
    if support[best] < max(2, majority(count)):
        return None, []
    far = [(candidates[j], distances[best][j] / scale) for j in range(count)
           if distances[best][j] > tolerance]
    return candidates[best], far
