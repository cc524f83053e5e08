"""Element-wise cast codecs: identity (fp32, lossless), fp16 and bf16 (2 bytes per element).

Description: {"codec": "identity" | "fp16" | "bf16", "shape": [...]}; payload: the elements
in that dtype, little-endian, row-major.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from protocol.codecs.base import Codec, DescriptionReader, Encoded, payload_view, register_codec, \
    tensor_from_bytes, tensor_to_bytes
from protocol.errors import CodecError

_KEYS = frozenset({"codec", "shape"})


def payload_length(count: int, wire_dtype: torch.dtype) -> int:
    """Bytes of `count` elements in `wire_dtype`."""
    return count * torch.empty(0, dtype=wire_dtype).element_size()


class CastCodec(Codec):
    """Sends every element in `wire_dtype`; decodes back to fp32."""

    wire_dtype: torch.dtype

    def _encode(self, values: torch.Tensor, name: str) -> Encoded:
        wire = values.to(self.wire_dtype)
        if not bool(torch.isfinite(wire).all()):
            raise CodecError(f"tensor {name!r} exceeds the range of {self.name}; use bf16 or identity.")
        return Encoded(self.layout(tuple(values.shape))[0], tensor_to_bytes(wire))

    def layout(self, shape: tuple[int, ...], name: str = "") -> tuple[dict[str, Any], int]:
        return {"codec": self.name, "shape": list(shape)}, payload_length(math.prod(shape), self.wire_dtype)

    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        reader = DescriptionReader(description, self.decodes, _KEYS)
        shape = reader.shape(max_elements)
        view = payload_view(payload, payload_length(math.prod(shape), self.wire_dtype), self.name)
        return tensor_from_bytes(view, self.wire_dtype).to(torch.float32).reshape(shape)


@register_codec
class IdentityCodec(CastCodec):
    """fp32 as is: lossless, 4 bytes per element."""

    name = "identity"
    decodes = ("identity",)
    wire_dtype = torch.float32


@register_codec
class Float16Codec(CastCodec):
    """IEEE half precision: 2 bytes per element, ~3 decimal digits, range ±65504."""

    name = "fp16"
    decodes = ("fp16",)
    wire_dtype = torch.float16


@register_codec
class BFloat16Codec(CastCodec):
    """bfloat16: 2 bytes per element, fp32's range with ~2 decimal digits."""

    name = "bf16"
    decodes = ("bf16",)
    wire_dtype = torch.bfloat16
