"""Named torch tensors <-> the network layer's raw tensors (p2p/messages.py), in one place.

Tensors travel as (name, dtype, shape, bytes); bfloat16 travels as its raw 16-bit patterns.
Decoding copies into fresh fp32 tensors, so nothing received aliases a network buffer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from p2p.messages import OutgoingTensor

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_OF_WIRE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WIRE_OF_TORCH = {v: k for k, v in TORCH_OF_WIRE.items()}


def to_wire(tensors: Mapping[str, torch.Tensor], dtype: str, prefix: str = "") -> list[OutgoingTensor]:
    """Casts to the wire dtype (bf16 by default for NoLoCo snapshots) on the CPU."""
    torch_dtype = WIRE_DTYPES[dtype]
    out = []
    for name, tensor in tensors.items():
        cast = tensor.detach().to("cpu", torch_dtype).contiguous()
        out.append(OutgoingTensor(prefix + name, WIRE_OF_TORCH[torch_dtype], tuple(cast.shape),
                                  cast.view(torch.uint8).numpy()))
    return out


def from_wire(received, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a ReceivedMessage whose names start with `prefix`, as fp32 copies.

    Only the float dtypes above are accepted; the network layer already checked every size.
    """
    result = {}
    for full_name, (entry, view) in received.tensor_views().items():
        if not full_name.startswith(prefix):
            continue
        if entry.dtype not in TORCH_OF_WIRE:
            raise ValueError(f"tensor {full_name} arrived as {entry.dtype}, not a float dtype")
        raw = torch.frombuffer(bytearray(view), dtype=TORCH_OF_WIRE[entry.dtype])
        result[full_name[len(prefix):]] = raw.view(entry.shape).to(torch.float32)
    return result
