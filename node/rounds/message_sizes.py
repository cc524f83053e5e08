"""The largest message of every kind a swarm's manifest makes its members exchange, and the
transport limits that follow from them (p2p/sizing.py), so that limits follow the model and its
encoding instead of constants.

Per kind, for a model of n parameters (its shapes from the manifest's model, built on torch's
meta device: nothing is allocated):

    NoLoCo snapshot   exactly node/rounds/noloco/payload.py snapshot_bytes (θ, or φ and Δ, in
                      protocol.wire_dtype)
    state             φ and the outer momentum in fp32, 8n bytes (node/rounds/state.py): what a
                      late joiner downloads and a diverged DiLoCoX member resyncs
    DiLoCoX message   at most 4 bytes a parameter (fp32, the identity codec; every other codec
                      sends fewer) plus CODEC_SLACK_BYTES a tensor, and the descriptions blob
    match messages    no tensors

`transport_limits` raises LimitsError in one sentence when the swarm's messages cannot fit the
transport on this machine: the daemon calls it before it builds its model.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

from node.config.manifest import Manifest
from node.rounds.dilocox.payload import DESCRIPTIONS, MAX_DESCRIPTIONS_BYTES, PAYLOAD
from node.rounds.noloco.payload import GROUPS as SNAPSHOT_GROUPS
from node.rounds.state import GROUPS as STATE_GROUPS
from node.rounds.wire_tensors import QUANTIZED_BITS, tensor_wire_bytes
from p2p.limits import TransferLimits, WireLimits
from p2p.sizing import MessageBound, limits_for
from p2p.wire import TensorEntry

# A codec's payload for one tensor beyond 4 bytes an element: a blockwise scale rounded up (a
# tensor of one element: 4 + 1 bytes), low-rank factors' per-column scales.
CODEC_SLACK_BYTES = 64
WIRE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
REMEDY = ("choose a smaller model or protocol.wire_dtype in the swarm's manifest, or join from a "
          "machine with more memory")


def parameter_shapes(manifest: Manifest, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The model's parameters, name -> shape, as the trainer names them; nothing allocated."""
    from node.train.model import build_model
    model = build_model(manifest.model, manifest.model.vocab_size or vocab_size, device="meta")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _entries(shapes: dict[str, tuple[int, ...]], prefix: str, wire_dtype: str) -> list[TensorEntry]:
    out = []
    for name, shape in shapes.items():
        nbytes = tensor_wire_bytes(math.prod(shape), wire_dtype)
        if wire_dtype in QUANTIZED_BITS:  # one flat uint8 tensor (node/rounds/wire_tensors.py)
            out.append(TensorEntry(prefix + name, "uint8", (nbytes,), nbytes))
        else:
            out.append(TensorEntry(prefix + name, WIRE_NAMES[wire_dtype], shape, nbytes))
    return out


def message_bounds(manifest: Manifest, shapes: dict[str, tuple[int, ...]]) -> list[MessageBound]:
    """The largest message of every kind the manifest's protocol exchanges."""
    protocol = manifest.protocol
    bounds = [MessageBound("the late-join state (φ and outer momentum in fp32)",
                           tuple(e for g in STATE_GROUPS for e in _entries(shapes, g + "/", "fp32"))),
              MessageBound("a control message", ())]
    if protocol.name == "noloco":
        bounds.append(MessageBound(
            f"a NoLoCo snapshot ({protocol.snapshot} in {protocol.wire_dtype})",
            tuple(e for g in SNAPSHOT_GROUPS[protocol.snapshot]
                  for e in _entries(shapes, g + "/", protocol.wire_dtype))))
    else:
        bounds.append(dilocox_message_bound(manifest, shapes))
    return bounds


def dilocox_message_bound(manifest: Manifest, shapes: dict[str, tuple[int, ...]]) -> MessageBound:
    """The largest DiLoCoX message (a round's pseudo-gradient) the manifest's codec sends."""
    codec = [TensorEntry(PAYLOAD + e.name, "uint8", (e.nbytes + CODEC_SLACK_BYTES,),
                         e.nbytes + CODEC_SLACK_BYTES) for e in _entries(shapes, "", "fp32")]
    descriptions = TensorEntry(DESCRIPTIONS, "uint8", (MAX_DESCRIPTIONS_BYTES,), MAX_DESCRIPTIONS_BYTES)
    return MessageBound(f"a DiLoCoX message (codec {manifest.protocol.codec})", (descriptions, *codec))


def round_message_bytes(manifest: Manifest, vocab_size: int) -> int | None:
    """The most payload bytes a member's round message of the manifest's protocol may declare
    (the exchange refuses a larger push unread); None where the protocol checks its own
    (a NoLoCo snapshot has exactly the bytes of ours)."""
    if manifest.protocol.name != "dilocox":
        return None
    return dilocox_message_bound(manifest, parameter_shapes(manifest, vocab_size)).total_bytes


def machine_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def transport_limits(manifest: Manifest, vocab_size: int, memory_bytes: int | None = None,
                     transfer: TransferLimits = TransferLimits()) -> tuple[WireLimits, TransferLimits]:
    """The transport's limits for this swarm, from this node's knobs (`transfer`) and the
    swarm's minimum link rate (protocol.min_link_mbit_s); LimitsError (one sentence) when its
    largest message cannot fit the transport within `memory_bytes` (default: this machine's)."""
    shapes = parameter_shapes(manifest, vocab_size)
    memory = machine_memory_bytes() if memory_bytes is None else memory_bytes
    transfer = replace(transfer, min_rate_bytes_per_s=min_rate_bytes_per_s(manifest))
    return limits_for(message_bounds(manifest, shapes), memory_bytes=memory, transfer=transfer,
                      remedy=f"swarm '{manifest.swarm.id}' cannot run here; {REMEDY}")


def min_rate_bytes_per_s(manifest: Manifest) -> float:
    """The swarm's declared minimum link rate, in bytes a second."""
    return manifest.protocol.min_link_mbit_s * 1e6 / 8
