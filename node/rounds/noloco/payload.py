"""What a NoLoCo round sends and receives: its snapshot on the wire, in one place.

The manifest's `protocol.snapshot` says what travels, as groups of named tensors in `wire_dtype`
(bf16 by default, see node/rounds/wire_tensors.py):
- "theta" (the default; needs β = γ): the fast weights θ = φ + Δ alone, "theta/<name>": one
  model-sized set of tensors. The receiver uses it as the snapshot (θ, 0), exact when β = γ
  (protocol/noloco.py theta_only_snapshot).
- "phi_delta": "phi/<name>" and "delta/<name>": two sets, twice the bytes; any β and γ.
`decode_snapshot` reads any received message (p2p's ReceivedMessage, or the simulator's
in-memory copy) into fp32 tensors by group. A message holding a group the layout does not name
(the other layout, say) is refused with reason "layout"; the tensors it returns are still
unchecked (node/rounds/noloco/round.py checks them with node/rounds/contributions.py).
"""

from __future__ import annotations

from typing import Any

import torch

from node.rounds.contributions import ContributionRefused
from node.rounds.wire_tensors import from_wire, to_wire
from protocol.noloco import NoLoCoSnapshot

GROUPS = {"theta": ("theta",), "phi_delta": ("phi", "delta")}


def tensor_sets(layout: str) -> int:
    """How many model-sized sets of tensors one snapshot of `layout` sends (its bytes are this
    times the model's elements times the wire dtype's size)."""
    return len(GROUPS[layout])


def encode_snapshot(snapshot: NoLoCoSnapshot, wire_dtype: str, layout: str) -> list:
    if layout == "theta":
        return to_wire(snapshot.fast_weights(), wire_dtype, "theta/")
    return (to_wire(snapshot.slow_weights, wire_dtype, "phi/")
            + to_wire(snapshot.local_progress, wire_dtype, "delta/"))


def decode_snapshot(message: Any, layout: str, sender: str) -> dict[str, dict[str, torch.Tensor]]:
    """{group: {name: fp32 tensor}} for the groups of `layout`; ContributionRefused("layout")
    when the message holds tensors of any other group."""
    expected = GROUPS[layout]
    found = sorted({name.partition("/")[0] for name in message.tensor_views()})
    if any(group not in expected for group in found):
        raise ContributionRefused(
            "layout", f"NoLoCo snapshot from {sender} carries the groups {found}, but "
            f"protocol.snapshot = {layout!r} sends {list(expected)}; dropped")
    return {group: from_wire(message, group + "/") for group in expected}
