"""The plausible-noise check: a contribution must carry the structure honest progress carries.

Replicas of one model training on one distribution move the same coordinates by similar amounts
(the inner optimizer's per-coordinate scales, the frequent tokens' embedding rows), even where
the directions of their updates are uncorrelated, as at a plateau (cosines within the noise:
benchmarks/NOTEBOOK.md, the soak). Random noise scaled to a plausible norm, tensor by tensor,
moves every coordinate of a tensor alike. A contribution x is scored against the node's own
progress r of the same round by s(x, r) (protocol/structure.py: the element-weighted mean over
tensors of corr(|x_t|, |r_t|); for x independent of r, s ≈ N(0, 1/N)).

Judged against the swarm, not against the node's own update: x is refused when

    s < max(floor_sigmas / √N,  ratio · median(the last `window` scores this node accepted))

the median once `warmup` scores were accepted (before that, the noise floor alone). So a sender
is held to what the other members' contributions scored recently, whatever the training phase,
and the bar follows the swarm down a plateau. NoLoCo applies it to a partner's progress Δ_j
against its own Δ_i, so only to snapshots that carry Δ (protocol.snapshot = "phi_delta"); a θ
snapshot's θ_j − φ_i mixes the partner's φ into it, and honest and noise partners' scores then
overlapped in simulation. DiLoCoX judges each sender against the others of its round instead
(protocol/dilocox.py), so every node leaves out the same senders.

What it does not catch (measured or argued in benchmarks/NOTEBOOK.md): noise that copies the
magnitudes of the sender's own honest update and randomises only its signs.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping

import torch

from node.rounds.contributions import ContributionRefused
from protocol.structure import magnitude_score

WINDOW = 16   # accepted scores remembered: the swarm's recent statistics
WARMUP = 4    # accepted scores before the median bar applies
FLOOR_SIGMAS = 5.0


class NoiseCheck:
    """One node's check: its bar (noise floor, then the median of recently accepted scores)."""

    def __init__(self, ratio: float, window: int = WINDOW, warmup: int = WARMUP,
                 floor_sigmas: float = FLOOR_SIGMAS):
        self.ratio, self.warmup, self.floor_sigmas = ratio, warmup, floor_sigmas
        self.accepted: deque[float] = deque(maxlen=window)

    @property
    def enabled(self) -> bool:
        return self.ratio > 0

    def bar(self, elements: int) -> float:
        floor = self.floor_sigmas / math.sqrt(max(elements, 1))
        if len(self.accepted) < self.warmup:
            return floor
        return max(floor, self.ratio * statistics.median(self.accepted))

    def check(self, sender: str, received: Mapping[str, torch.Tensor],
              reference: Mapping[str, torch.Tensor], what: str) -> float:
        """Raises ContributionRefused("noise") below the bar; else remembers and returns s."""
        score, elements = magnitude_score(received, reference)
        if elements == 0:  # nothing to compare (a reference of zeros): nothing to judge
            return score
        bar = self.bar(elements)
        if score < bar:
            raise ContributionRefused("noise", f"{what} from {sender} looks like noise: its "
                                      f"magnitudes follow this node's own progress with "
                                      f"correlation {score:.3g}, below the bar {bar:.3g} (the "
                                      f"noise floor or {self.ratio:g}x the median of the swarm's "
                                      f"recent contributions); dropped")
        self.accepted.append(score)
        return score
