"""How much a set of tensors follows another's per-coordinate magnitudes (the noise checks).

    s(x, r) = Σ_t n_t · corr(|x_t|, |r_t|) / Σ_t n_t

corr is the Pearson correlation over the n_t elements of tensor t; tensors of one element, or
whose magnitudes are constant in x or in r, are skipped (they carry no pattern). For x drawn
independently of r, s ≈ N(0, 1/N), N = Σ_t n_t over the tensors counted: the noise floor.

Replicas of one model on one distribution move the same coordinates by similar amounts (the
inner optimizer's per-coordinate scales, the frequent tokens' rows) even where the directions
of their updates are unrelated, while noise of a plausible norm, tensor by tensor, moves every
coordinate of a tensor alike. Used by node/rounds/noise_check.py (NoLoCo) and
protocol/dilocox.py (its aggregation).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


@torch.no_grad()
def magnitude_score(x: Mapping[str, torch.Tensor], r: Mapping[str, torch.Tensor]) -> tuple[float, int]:
    """(s(x, r), N). `r` holds every name of `x`, with the same shapes."""
    total, count = 0.0, 0
    for name, tensor in x.items():
        a = tensor.detach().reshape(-1).float().abs()
        b = r[name].detach().reshape(-1).float().abs()
        if a.numel() < 2:
            continue
        a, b = a - a.mean(), b - b.mean()
        scale = float(a.norm()) * float(b.norm())
        if scale == 0.0:
            continue
        total += float(a @ b) / scale * a.numel()
        count += a.numel()
    return (total / count if count else 0.0), count
