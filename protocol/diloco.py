"""DiLoCo's outer step (docs/protocols.md §2, arXiv 2311.08105): torch SGD's Nesterov step, each
operation rounded once.

    Δ_i = φ − θ_i                     (old minus new: DiLoCo's sign, opposite to NoLoCo's)
    Δ̄   = mean over all nodes of Δ_i
    m  ← μ·m + Δ̄ ;  φ ← φ − η·(Δ̄ + μ·m)   (torch.optim.SGD's update with nesterov=True)

The code mirrors the formula one elementwise operation at a time (a product by a scalar, then a
sum), not torch.optim.SGD: SGD computes `a + α·b` in one call, which torch's vectorized kernels
fuse into one multiply-add and its scalar code may not, so the same step gave different bits on
one machine with ATEN_CPU_CAPABILITY=avx2 and its default (AVX-512); DiLoCoX nodes on different
CPUs would split φ every round. A product and a sum each rounded once give the same bits on any
hardware. DiLoCoX (protocol/dilocox.py) reuses `DiLoCo.apply_mean` for its outer step.

Invariant: nodes that start from the same φ and m and apply the same Δ̄ (same numbers, same
summation order, see `protocol.tensors.mean`) hold bitwise identical φ and m, on any CPU or GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from protocol.errors import ConfigurationError, LayoutError
from protocol.tensors import NamedTensors, check_same_layout, difference, fp32_clone, mean


@dataclass(frozen=True)
class DiLoCoHyperParameters:
    """Outer optimizer settings: η (outer_lr) and μ (momentum), as torch SGD names them.

    `nesterov=False` gives plain heavy-ball momentum (m ← μ·m + Δ̄ ; φ ← φ − η·m), the form
    NoLoCo's δ update takes when the whole swarm is one group (see tests/unit/test_noloco.py).
    """

    outer_lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.outer_lr, (int, float)) and math.isfinite(self.outer_lr)
                and self.outer_lr > 0):
            raise ConfigurationError(f"outer_lr must be a finite number > 0, got {self.outer_lr!r}.")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise ConfigurationError(f"momentum must be in [0, 1), got {self.momentum!r}.")
        if self.nesterov and self.momentum == 0:
            raise ConfigurationError("nesterov=True needs momentum > 0 (torch's rule).")


class DiLoCo:
    """One node's DiLoCo outer state: φ and the outer momentum m.

    Round use: `delta = node.pseudo_gradient(theta)`; gather every node's delta; then
    `phi = node.outer_step(deltas)` and restart θ from `phi`.
    """

    def __init__(self, initial_weights: Mapping[str, torch.Tensor],
                 hyper: DiLoCoHyperParameters | None = None) -> None:
        self.hyper = hyper if hyper is not None else DiLoCoHyperParameters()
        self._slow_weights = fp32_clone(initial_weights, what="initial_weights")
        if not self._slow_weights:
            raise LayoutError("initial_weights holds no tensors; a model needs at least one.")
        self._names = list(self._slow_weights)
        self._momentum = {name: torch.zeros_like(t) for name, t in self._slow_weights.items()}

    @property
    def slow_weights(self) -> NamedTensors:
        """A copy of φ (a copy, so that training θ in place never touches φ)."""
        return fp32_clone(self._slow_weights, what="slow weights")

    @property
    def momentum(self) -> NamedTensors:
        """A copy of the outer momentum m (zeros before the first step)."""
        return fp32_clone(self._momentum, what="momentum")

    def slow_weights_minus(self, tensors: Mapping[str, torch.Tensor]) -> NamedTensors:
        """φ − `tensors`, new tensors (φ is read in place, not copied first)."""
        return difference(self._slow_weights, tensors)

    def pseudo_gradient(self, fast_weights: Mapping[str, torch.Tensor]) -> NamedTensors:
        """Δ = φ − θ for this node's fast weights θ at the end of a round (DiLoCo's and
        DiLoCoX's sign: a gradient-like direction, φ moves against it)."""
        return self.slow_weights_minus(fast_weights)

    def outer_step(self, pseudo_gradients: Sequence[Mapping[str, torch.Tensor]]) -> NamedTensors:
        """Average every node's Δ (in the order given) and apply it; returns the new φ."""
        return self.apply_mean(mean(pseudo_gradients))

    def apply_mean(self, mean_pseudo_gradient: Mapping[str, torch.Tensor]) -> NamedTensors:
        """One outer step on φ with the mean pseudo-gradient Δ̄; returns a copy of the new φ."""
        check_same_layout(self._slow_weights, mean_pseudo_gradient, what="mean pseudo-gradient")
        eta, mu = self.hyper.outer_lr, self.hyper.momentum
        with torch.no_grad():
            for name, phi in self._slow_weights.items():
                delta = mean_pseudo_gradient[name].detach().to(torch.float32)
                m = self._momentum[name]
                m.mul_(mu).add_(delta)                     # m ← μ·m + Δ̄
                step = m * mu + delta if self.hyper.nesterov else m.clone()  # Δ̄ + μ·m, or m
                phi.sub_(step.mul_(eta))                   # φ ← φ − η·step
        return self.slow_weights

    def state_dict(self) -> dict[str, Any]:
        """φ and m by name, plus the hyper-parameters they were made with (for checkpoints)."""
        return {"slow_weights": self.slow_weights, "momentum": self.momentum,
                "hyper": {"outer_lr": self.hyper.outer_lr, "momentum": self.hyper.momentum,
                          "nesterov": self.hyper.nesterov}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore φ and m from `state_dict()` output; the tensor layout must match this model."""
        try:
            slow, momentum = state["slow_weights"], state["momentum"]
        except (KeyError, TypeError) as missing:
            raise LayoutError(f"DiLoCo state lacks the field {missing}.") from None
        check_same_layout(self._slow_weights, slow, what="checkpoint slow_weights")
        check_same_layout(self._slow_weights, momentum, what="checkpoint momentum")
        with torch.no_grad():
            for name, parameter in self._slow_weights.items():
                parameter.copy_(slow[name])
                self._momentum[name].copy_(momentum[name])
