"""NoLoCo's outer step (docs/protocols.md §1, arXiv 2506.10911), as its official code computes it.

Per node i, with outer momentum δ_i (starts at 0) and a group G ∋ i of size n:

    Δ_j  = θ_j − φ_j                                            (local progress; NEW minus OLD)
    δ_i ← α·δ_i + β·mean_{j∈G} Δ_j − γ·(φ_i − mean_{j∈G} φ_j)
    φ_i ← φ_i + δ_i
    θ_i ← φ_i                                                   (the next round starts here)

Sign: the paper prints −β on the Δ term; its convergence proof and official code use +β, and
so does this module (docs/protocols.md §1). This is heavy-ball momentum, not torch's Nesterov.
With G = {i} alone the γ term is zero and the update is local. With G = every replica and equal
φ everywhere, the δ update is DiLoCo's heavy-ball form with μ = α and η = β on DiLoCo's
Δ = φ − θ (tests/unit/test_noloco.py checks this against torch's SGD).

A node publishes a `NoLoCoSnapshot` (φ_i, Δ_i) at the end of a round; snapshots carry their own φ
because a partner's may be of another round.

What the update really needs (docs/protocols.md §1): with β = γ (the default) a partner j enters
both formulas only through β·θ_j, so its fast weights θ_j = φ_j + Δ_j alone suffice, one tensor
instead of two. `theta_only_snapshot` turns such a θ_j into a snapshot the formulas below take
unchanged (the proof is in its docstring); with β ≠ γ it refuses, and both tensors must travel.

Overlap timing, and why a correction (docs/protocols.md §1): a first design had a node use, at
the end of round r, its own round-r snapshot with the partner's round-(r−1) one. Measured, that
ended +5.85% above DiLoCo and above local-only training (benchmarks/NOTEBOOK.md): the consensus term pulls
each node towards a φ one outer step old, and the mean mixes progress of two rounds. Here the
round ends with the local update, and when the partner's round-(r−1) snapshot arrives (during
round r) `late_pair_correction` adds what that pair's update would have added, to φ, δ and θ:
the node ends where the paper's blocking update on the two round-(r−1) snapshots would have put
it, with round r's progress on top and no wait.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from protocol.errors import ConfigurationError, LayoutError
from protocol.tensors import NamedTensors, check_same_layout, difference, fp32_clone, zeros_like


@dataclass(frozen=True)
class NoLoCoHyperParameters:
    """α (momentum), β (progress_weight) and γ (consensus_weight); the paper's defaults.

    The paper's stability condition for pairs (n = 2) is α < γ < √(2 + α²). Values outside it
    raise ConfigurationError, unless `allow_unstable=True`, which only warns (for experiments).
    """

    momentum: float = 0.5          # α
    progress_weight: float = 0.7   # β
    consensus_weight: float = 0.7  # γ
    allow_unstable: bool = False

    def __post_init__(self) -> None:
        for field_name in ("momentum", "progress_weight", "consensus_weight"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigurationError(f"NoLoCo {field_name} must be a finite number, got {value!r}.")
        if not 0 <= self.momentum < 1:
            raise ConfigurationError(f"NoLoCo momentum α must be in [0, 1), got {self.momentum}.")
        if self.progress_weight <= 0:
            raise ConfigurationError(f"NoLoCo progress_weight β must be > 0, got {self.progress_weight}.")
        if self.consensus_weight < 0:
            raise ConfigurationError(
                f"NoLoCo consensus_weight γ must be >= 0, got {self.consensus_weight}.")
        problem = self.pair_stability_problem()
        if problem is not None:
            if not self.allow_unstable:
                raise ConfigurationError(problem + " Pass allow_unstable=True to run it anyway.")
            warnings.warn(problem, RuntimeWarning, stacklevel=3)

    def pair_stability_problem(self) -> str | None:
        """The sentence saying how α < γ < √(2 + α²) fails for n = 2, or None when it holds."""
        alpha, gamma = self.momentum, self.consensus_weight
        upper = math.sqrt(2 + alpha * alpha)
        if not alpha < gamma < upper:
            return (f"NoLoCo is unstable for pairs: it needs α < γ < √(2 + α²), "
                    f"i.e. {alpha} < γ < {upper:.4f}, but γ = {gamma}.")
        return None


@dataclass(frozen=True)
class NoLoCoSnapshot:
    """What a node publishes after a round: its φ and its local progress Δ = θ − φ."""

    slow_weights: Mapping[str, torch.Tensor]
    local_progress: Mapping[str, torch.Tensor]

    def __post_init__(self) -> None:
        check_same_layout(self.slow_weights, self.local_progress, what="snapshot local_progress")

    def fast_weights(self) -> NamedTensors:
        """θ = φ + Δ in fp32 (what a snapshot sends when β = γ)."""
        return {name: phi.to(torch.float32) + self.local_progress[name].to(torch.float32)
                for name, phi in self.slow_weights.items()}


def theta_only_snapshot(fast_weights: Mapping[str, torch.Tensor],
                        hyper: NoLoCoHyperParameters) -> NoLoCoSnapshot:
    """A partner j known only by its fast weights θ_j, as the snapshot (φ = θ_j, Δ = 0).

    Valid only when β = γ: then, for `noloco_update` and `late_pair_correction` alike, this
    snapshot changes φ_i and δ_i exactly as the partner's true (φ_j, Δ_j) would.

    Proof. In G of size n, partner j appears in both formulas only through the group means,
    i.e. through the terms β·Δ_j/n (in β·mean Δ) and γ·φ_j/n (in −γ·(φ_i − mean φ)); nothing
    else reads it. Their sum is (β·Δ_j + γ·φ_j)/n. With β = γ that is β·(φ_j + Δ_j)/n = β·θ_j/n,
    and the snapshot (θ_j, 0) gives (β·0 + γ·θ_j)/n = β·θ_j/n: the same. The node's own snapshot
    stays exact, so the outer step reads, as docs/protocols.md §1 writes it,

        δ_i ← α·δ_i + β·(mean_{j∈G} θ_j − φ_i)

    and the late correction is c = β·(mean_G θ − θ_i). With β ≠ γ the sum needs φ_j and Δ_j
    apart, so this raises ConfigurationError.
    """
    beta, gamma = hyper.progress_weight, hyper.consensus_weight
    if beta != gamma:
        raise ConfigurationError(
            f"a partner known only by its fast weights θ needs progress_weight β = consensus_weight "
            f"γ, but β = {beta} and γ = {gamma}: send both φ and Δ (protocol.snapshot = 'phi_delta').")
    slow = fp32_clone(fast_weights, what="partner fast weights θ")
    # Δ = 0 as a broadcast zero, one element a tensor: read-only, like every snapshot, and on a
    # `medium` GPU node 5.4 GB that a partner's correction does not allocate
    zero = {name: torch.zeros((), dtype=torch.float32, device=t.device).expand(t.shape)
            for name, t in slow.items()}
    return NoLoCoSnapshot(slow_weights=slow, local_progress=zero)


def noloco_update(slow_weights: Mapping[str, torch.Tensor], outer_momentum: Mapping[str, torch.Tensor],
                  group: Sequence[NoLoCoSnapshot], hyper: NoLoCoHyperParameters,
                  ) -> tuple[NamedTensors, NamedTensors]:
    """The NoLoCo formula for one node: returns (new φ_i, new δ_i); inputs are not modified.

    `group` is G, this node's own snapshot included (its φ must be `slow_weights`). Group
    means are summed in the order given.
    """
    if not group:
        raise LayoutError("NoLoCo group G is empty; it must contain at least the node itself.")
    check_same_layout(slow_weights, outer_momentum, what="outer momentum δ")
    for index, snapshot in enumerate(group):
        check_same_layout(slow_weights, snapshot.slow_weights, what=f"group[{index}] slow_weights")
    alpha, beta, gamma = hyper.momentum, hyper.progress_weight, hyper.consensus_weight
    size = len(group)
    new_slow: NamedTensors = {}
    new_momentum: NamedTensors = {}
    for name, phi in slow_weights.items():
        phi = phi.to(torch.float32)
        mean_progress = sum(s.local_progress[name].to(torch.float32) for s in group) / size
        mean_slow = sum(s.slow_weights[name].to(torch.float32) for s in group) / size
        # +β: the official code's sign (docs/protocols.md §1), not the paper's printed −β.
        delta = alpha * outer_momentum[name].to(torch.float32) + beta * mean_progress \
            - gamma * (phi - mean_slow)
        new_momentum[name] = delta
        new_slow[name] = phi + delta
    return new_slow, new_momentum


class NoLoCo:
    """One node's NoLoCo outer state: φ (slow weights) and δ (outer momentum, starts at 0).

    Round use: `own = node.snapshot(theta)`; publish it; get partner snapshots (zero or more);
    `phi = node.outer_step(own, partners)`; restart θ from `phi`.
    """

    def __init__(self, initial_weights: Mapping[str, torch.Tensor],
                 hyper: NoLoCoHyperParameters | None = None) -> None:
        self.hyper = hyper if hyper is not None else NoLoCoHyperParameters()
        self._slow_weights = fp32_clone(initial_weights, what="initial_weights")
        if not self._slow_weights:
            raise LayoutError("initial_weights holds no tensors; a model needs at least one.")
        self._outer_momentum = zeros_like(self._slow_weights)

    @property
    def slow_weights(self) -> NamedTensors:
        """A copy of φ."""
        return fp32_clone(self._slow_weights, what="slow weights")

    @property
    def outer_momentum(self) -> NamedTensors:
        """A copy of δ."""
        return fp32_clone(self._outer_momentum, what="outer momentum")

    def snapshot(self, fast_weights: Mapping[str, torch.Tensor]) -> NoLoCoSnapshot:
        """This node's (φ, Δ = θ − φ) at the end of a round; copies, safe to publish."""
        return NoLoCoSnapshot(slow_weights=self.slow_weights,
                              local_progress=difference(fast_weights, self._slow_weights))

    def outer_step(self, own: NoLoCoSnapshot, partners: Sequence[NoLoCoSnapshot] = ()) -> NamedTensors:
        """Apply the update with G = {own} ∪ partners; returns a copy of the new φ.

        No partners (none found before the deadline) gives the local update of G = {i}.
        """
        for name, phi in self._slow_weights.items():
            own_phi = own.slow_weights.get(name)
            if own_phi is None or not torch.equal(own_phi.to(torch.float32), phi):
                raise LayoutError("own snapshot was not taken from this node's current slow weights "
                                  f"(tensor {name!r} differs); take it with snapshot() this round.")
        self._slow_weights, self._outer_momentum = noloco_update(
            self._slow_weights, self._outer_momentum, [own, *partners], self.hyper)
        return self.slow_weights

    def late_pair_correction(self, own_previous: NoLoCoSnapshot,
                             partners: Sequence[NoLoCoSnapshot]) -> NamedTensors:
        """The overlap timing's pair update, one round late, as a correction; returns c.

        The node took the local update (G = {i}) at the end of the round of `own_previous`, and
        its partners' snapshots of that round arrived while it trained the next one. Had they
        been there in time, δ would have been larger by

            c = β·(mean_G Δ − Δ_i) − γ·(φ_i − mean_G φ)      (G = {own_previous} ∪ partners)

        (the formula's difference between G and {i}; the α·δ term is the same in both; with
        partners from `theta_only_snapshot`, β = γ, it is c = β·(mean_G θ − θ_i)). This
        adds c to φ and δ; the caller adds it to θ, so the round in progress keeps its own
        progress (θ − φ is unchanged) and from then on the node is where NoLoCo with that pair
        would have put it, up to the inner optimizer's nonlinearity.
        """
        if not partners:
            return zeros_like(self._slow_weights)
        group = [own_previous, *partners]
        for index, snapshot in enumerate(group):
            check_same_layout(self._slow_weights, snapshot.slow_weights, what=f"group[{index}] slow_weights")
            check_same_layout(self._slow_weights, snapshot.local_progress,
                              what=f"group[{index}] local_progress")
        beta, gamma, size = self.hyper.progress_weight, self.hyper.consensus_weight, len(group)
        correction: NamedTensors = {}
        for name in self._slow_weights:
            own_phi = own_previous.slow_weights[name].to(torch.float32)
            own_progress = own_previous.local_progress[name].to(torch.float32)
            mean_progress = sum(s.local_progress[name].to(torch.float32) for s in group) / size
            mean_slow = sum(s.slow_weights[name].to(torch.float32) for s in group) / size
            correction[name] = beta * (mean_progress - own_progress) - gamma * (own_phi - mean_slow)
        for name, c in correction.items():
            self._slow_weights[name] = self._slow_weights[name] + c
            self._outer_momentum[name] = self._outer_momentum[name] + c
        return correction  # fresh tensors: φ and δ above are new ones, nothing here aliases c

    def state_dict(self) -> dict[str, Any]:
        """φ and δ by name, for checkpoints."""
        return {"slow_weights": self.slow_weights, "outer_momentum": self.outer_momentum}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore φ and δ from `state_dict()` output; the layout must match this model. They
        stay on the device the state lives on (a checkpoint or a peer's state comes from host
        memory)."""
        try:
            slow, momentum = state["slow_weights"], state["outer_momentum"]
        except (KeyError, TypeError) as missing:
            raise LayoutError(f"NoLoCo state lacks the field {missing}.") from None
        check_same_layout(self._slow_weights, slow, what="checkpoint slow_weights")
        check_same_layout(self._slow_weights, momentum, what="checkpoint outer_momentum")
        device = next(iter(self._slow_weights.values())).device
        self._slow_weights = fp32_clone(slow, what="checkpoint slow_weights", device=device)
        self._outer_momentum = fp32_clone(momentum, what="checkpoint outer_momentum", device=device)
