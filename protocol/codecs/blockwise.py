"""Blockwise absmax quantization to 8 or 4 bits, and the group quantizer low-rank reuses.

A tensor is flattened and cut into blocks of `block_size` elements (the last may be short).
Each block keeps one fp32 scale s = max|x| and integer codes q = round(x / s · L) with
L = 127 (8 bits) or L = 7 (4 bits); decoding gives x̂ = q · s / L. Per element the error is at
most s / (2L), so an outlier only coarsens its own block.

Description: {"codec": "blockwise", "shape": [...], "bits": 8|4, "block": int}.
Payload: nblocks fp32 scales, then the codes: int8 per element (8 bits), or two 4-bit codes
per byte stored as q + 8 (element 2i in the low nibble, 2i+1 in the high one; an odd count
leaves one padding nibble). The codes −128 (8 bits) and −8 (4 bits) are never produced and
are refused on decode.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.codecs.base import Codec, DescriptionReader, Encoded, integer_parameter, payload_view, \
    register_codec, tensor_from_bytes, tensor_to_bytes
from protocol.errors import CodecError

SUPPORTED_BITS = (4, 8)
MAX_BLOCK_SIZE = 1 << 20
_LEVELS = {8: 127, 4: 7}
_KEYS = frozenset({"codec", "shape", "bits", "block"})


# ------------------------------------------------------------------ group quantizer (shared)
def quantize_groups(groups: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax quantization of a 2-D fp32 tensor: (scales [rows], codes int8 [rows, cols])."""
    levels = _LEVELS[bits]
    scales = groups.abs().amax(dim=1) if groups.shape[1] \
        else torch.zeros(groups.shape[0], device=groups.device)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(groups / safe[:, None] * levels).clamp_(-levels, levels).to(torch.int8)
    return scales, codes


def dequantize_groups(scales: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `quantize_groups`: codes · scale / L per row, in fp32."""
    return codes.to(torch.float32) * (scales / _LEVELS[bits])[:, None]


def packed_length(count: int, bits: int) -> int:
    """Bytes that `count` codes take at `bits` bits each."""
    return count if bits == 8 else (count + 1) // 2


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Flat int8 codes to wire bytes (see the module docstring for the layout)."""
    flat = codes.reshape(-1)
    if bits == 8:
        return tensor_to_bytes(flat)
    offset = (flat.to(torch.int16) + 8).to(torch.uint8)
    if offset.numel() % 2:
        offset = torch.cat([offset, torch.tensor([8], dtype=torch.uint8, device=offset.device)])
    pairs = offset.reshape(-1, 2)
    return tensor_to_bytes(pairs[:, 0] | (pairs[:, 1] << 4))


def unpack_codes(view: memoryview, count: int, bits: int, codec: str) -> torch.Tensor:
    """Wire bytes (length already validated) to `count` flat int8 codes; refuses unused codes."""
    raw = tensor_from_bytes(view, torch.uint8)
    if bits == 8:
        codes = raw.view(torch.int8)
        if bool((codes == -128).any()):
            raise CodecError(f"{codec} payload holds the unused 8-bit code -128.")
        return codes
    nibbles = torch.stack([raw & 0x0F, raw >> 4], dim=1).reshape(-1)[:count]
    if bool((nibbles == 0).any()):
        raise CodecError(f"{codec} payload holds the unused 4-bit code -8.")
    return (nibbles.to(torch.int16) - 8).to(torch.int8)


def read_scales(view: memoryview, codec: str) -> torch.Tensor:
    """fp32 scales from the wire; each must be finite and >= 0."""
    scales = tensor_from_bytes(view, torch.float32)
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CodecError(f"{codec} payload holds a negative or non-finite scale.")
    return scales


# ------------------------------------------------------------------ the codec
@register_codec
class BlockwiseCodec(Codec):
    """Absmax quantization in blocks: bits 8 (~3.9× smaller than fp32) or 4 (~7.5×)."""

    name = "blockwise"
    decodes = ("blockwise",)

    def __init__(self, bits: int = 8, block_size: int = 64) -> None:
        if bits not in SUPPORTED_BITS or type(bits) is not int:
            raise CodecError(f"blockwise bits must be one of {list(SUPPORTED_BITS)}, got {bits!r}.")
        self.bits = bits
        self.block_size = integer_parameter(block_size, "blockwise block_size", 1, MAX_BLOCK_SIZE)

    def params(self) -> dict[str, Any]:
        return {"bits": self.bits, "block_size": self.block_size}

    def _encode(self, values: torch.Tensor, name: str) -> Encoded:
        flat = values.reshape(-1)
        count, block = flat.numel(), self.block_size
        blocks = -(-count // block)
        padded = torch.nn.functional.pad(flat, (0, blocks * block - count))
        scales, codes = quantize_groups(padded.reshape(blocks, block), self.bits)
        payload = tensor_to_bytes(scales) + pack_codes(codes.reshape(-1)[:count], self.bits)
        description = {"codec": self.name, "shape": list(values.shape), "bits": self.bits,
                       "block": block}
        return Encoded(description, payload)

    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        reader = DescriptionReader(description, self.decodes, _KEYS)
        shape = reader.shape(max_elements)
        bits = reader.choice("bits", SUPPORTED_BITS)
        block = reader.integer("block", 1, MAX_BLOCK_SIZE)
        count = 1
        for dim in shape:
            count *= dim
        blocks = -(-count // block)
        view = payload_view(payload, 4 * blocks + packed_length(count, bits), self.name)
        scales = read_scales(view[:4 * blocks], self.name)
        codes = unpack_codes(view[4 * blocks:], count, bits, self.name)
        # Full blocks as rows, then the short last one: nothing larger than `count` elements is
        # allocated, and no per-element index (8 bytes an element) either.
        step = scales / _LEVELS[bits]
        values = codes.to(torch.float32)
        full = count // block
        values[:full * block].view(full, block).mul_(step[:full, None])
        if count > full * block:
            values[full * block:].mul_(step[full])
        return values.reshape(shape)
