"""What a NoLoCo round sends and receives: its snapshot S = (φ, Δ) on the wire, in one place.

A snapshot travels as two groups of named tensors in `wire_dtype` (bf16 by default, see
node/rounds/wire_tensors.py): "phi/<name>" and "delta/<name>". `decode_snapshot` reads any
received message holding them (p2p's ReceivedMessage, or the simulator's in-memory copy) into
fp32 tensors; what it returns is still unchecked (node/rounds/contributions.py checks it).
"""

from __future__ import annotations

from typing import Any

from node.rounds.wire_tensors import from_wire, to_wire
from protocol.noloco import NoLoCoSnapshot

PHI, DELTA = "phi/", "delta/"


def encode_snapshot(snapshot: NoLoCoSnapshot, wire_dtype: str) -> list:
    return (to_wire(snapshot.slow_weights, wire_dtype, PHI)
            + to_wire(snapshot.local_progress, wire_dtype, DELTA))


def decode_snapshot(message: Any) -> NoLoCoSnapshot:
    return NoLoCoSnapshot(slow_weights=from_wire(message, PHI),
                          local_progress=from_wire(message, DELTA))
