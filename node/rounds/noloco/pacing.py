"""Rounds that fit the link: how often a NoLoCo node pairs.

In overlap timing a pair forms during round r and swaps the snapshots taken at the end of
round r − 1; the partner's lands while the node trains and corrects it then (protocol/noloco.py
late_pair_correction), up to `max_swap_rounds` rounds after r. On a link where a swap takes
longer than a round's compute, pairing every round would start a swap before the last one
ended: the swaps share the link, each takes longer still, and none lands in time. So each node
paces itself:

    interval k = clamp(⌈ median(last swaps' seconds) / median(last rounds' seconds) ⌉, 1, K)

and pairs in a round only when k rounds have passed since it last paired and, while k > 1, no
swap of its own is still in flight; in the other rounds it rests (announces "training", so no
peer proposes, and declines any proposal). K = protocol.max_swap_rounds, the bound on
staleness every node applies to a landing. Medians over a few swaps, so that one slow partner
does not make a fast node rest. When swaps fit again (k = 1) it pairs every round again.

Resting keeps the swarm's matching as it is: a pair is still formed by both sides' consent
(protocol/matching.py), so pairs stay mutual, and round differences stay bounded by
max_staleness as before. The pacer is pure (no clock, no I/O): the exchange feeds it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

SAMPLES = 5  # swaps and rounds remembered: a median of few, so that it follows a changed link


@dataclass
class SwapPacer:
    max_interval: int                     # K: protocol.max_swap_rounds
    interval: int = 1                     # k: pair once every k rounds
    last_paired_round: int | None = None
    swap_seconds: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    round_seconds: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))

    def __post_init__(self) -> None:
        if type(self.max_interval) is not int or self.max_interval < 1:
            raise ValueError(f"max_swap_rounds must be an int >= 1, got {self.max_interval!r}.")

    def record_swap(self, seconds: float) -> None:
        """A swap ended: from the pair's forming to the partner's snapshot received."""
        self.swap_seconds.append(max(0.0, seconds))

    def record_round(self, seconds: float) -> None:
        """A round ended after `seconds` of wall clock (its compute, as the node sees it)."""
        if seconds > 0:
            self.round_seconds.append(seconds)

    def update(self) -> int:
        """Recomputes k from what was measured; returns it."""
        if self.swap_seconds and self.round_seconds:
            ratio = statistics.median(self.swap_seconds) / statistics.median(self.round_seconds)
            self.interval = min(self.max_interval, max(1, math.ceil(ratio)))
        return self.interval

    def pairs_in(self, round_index: int, swap_in_flight: bool) -> bool:
        """Whether the node pairs in `round_index` (else it rests)."""
        if self.interval > 1 and swap_in_flight:
            return False
        return self.last_paired_round is None or round_index - self.last_paired_round >= self.interval

    def paired(self, round_index: int) -> None:
        self.last_paired_round = round_index
