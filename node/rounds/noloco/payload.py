"""What a NoLoCo round sends and receives: its snapshot on the wire, in one place.

The manifest's `protocol.snapshot` says what travels, as groups of named tensors in
`protocol.wire_dtype` (node/rounds/wire_tensors.py):
- "theta" (the default; needs β = γ): the fast weights θ = φ + Δ alone, "theta/<name>": one
  model-sized set of tensors. The receiver uses it as the snapshot (θ, 0), exact when β = γ
  (protocol/noloco.py theta_only_snapshot).
- "phi_delta": "phi/<name>" and "delta/<name>": two sets, twice the bytes; any β and γ.
Per model-sized set of n parameters, `protocol.wire_dtype` sends 2n bytes (bf16, the default;
fp16), 4n (fp32), or, quantized in blocks of 64 with one fp32 scale each, n + 4⌈n/64⌉ (int8)
or ⌈n/2⌉ + 4⌈n/64⌉ (int4), summed tensor by tensor (`snapshot_bytes` is exact).
A quantized θ_j is off by at most s/(2L) per element (s the absmax of its block of 64, L = 127
or 7); it enters the receiver's φ as β/2·θ_j, so the pair's φ moves by at most β/2·s/(2L) from
the exact update (Δ and φ alike in "phi_delta").
`decode_snapshot` reads any received message (p2p's ReceivedMessage, or the simulator's
in-memory copy) into fp32 tensors by group. A message holding a group the layout does not name
(the other layout, say) is refused with reason "layout"; a quantized one whose tensors, dtypes
or byte lengths differ from what the manifest and the receiver's own shapes imply, or whose
scales or codes are invalid, with reason "malformed", before anything is decoded where sizes
tell. The float tensors it returns are still unchecked (node/rounds/noloco/round.py checks
them with node/rounds/contributions.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from node.rounds.contributions import ContributionRefused
from node.rounds.wire_tensors import QUANTIZED_BITS, from_wire, from_wire_quantized, \
    tensor_wire_bytes, to_wire
from protocol.noloco import NoLoCoSnapshot

GROUPS = {"theta": ("theta",), "phi_delta": ("phi", "delta")}


def tensor_sets(layout: str) -> int:
    """How many model-sized sets of tensors one snapshot of `layout` sends (its bytes are this
    times `snapshot_bytes` of one set)."""
    return len(GROUPS[layout])


def snapshot_bytes(shapes: Mapping[str, tuple[int, ...]], wire_dtype: str, layout: str) -> int:
    """Exact tensor bytes of one snapshot of a model with these parameter shapes."""
    one_set = sum(tensor_wire_bytes(math.prod(shape), wire_dtype) for shape in shapes.values())
    return tensor_sets(layout) * one_set


def encode_snapshot(snapshot: NoLoCoSnapshot, wire_dtype: str, layout: str,
                    rounding: torch.Generator | None = None) -> list:
    """`rounding`: a quantized wire dtype rounds stochastically with this generator."""
    if layout == "theta":
        return to_wire(snapshot.fast_weights(), wire_dtype, "theta/", rounding)
    return (to_wire(snapshot.slow_weights, wire_dtype, "phi/", rounding)
            + to_wire(snapshot.local_progress, wire_dtype, "delta/", rounding))


def decode_snapshot(message: Any, layout: str, sender: str, wire_dtype: str = "bf16",
                    shapes: Mapping[str, tuple[int, ...]] | None = None,
                    device: torch.device | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{group: {name: fp32 tensor}} for the groups of `layout`, decoded on `device` (default
    the host: the wire's bytes cross, then are widened there); ContributionRefused("layout")
    when the message holds tensors of any other group. A quantized `wire_dtype` needs
    `shapes`, the receiver's own parameter shapes: ContributionRefused("malformed") when the
    message does not hold exactly those tensors, validly encoded."""
    expected = GROUPS[layout]
    found = sorted({name.partition("/")[0] for name in message.tensor_views()})
    if any(group not in expected for group in found):
        raise ContributionRefused(
            "layout", f"NoLoCo snapshot from {sender} carries the groups {found}, but "
            f"protocol.snapshot = {layout!r} sends {list(expected)}; dropped")
    if wire_dtype not in QUANTIZED_BITS:
        return {group: from_wire(message, group + "/", device=device) for group in expected}
    try:
        decoded = from_wire_quantized(message, wire_dtype, shapes, [g + "/" for g in expected], device)
    except ValueError as exc:
        raise ContributionRefused(
            "malformed", f"NoLoCo snapshot from {sender} is malformed: {exc}; dropped") from None
    return {group: decoded[group + "/"] for group in expected}
