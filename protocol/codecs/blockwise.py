"""Blockwise absmax quantization to 8 or 4 bits, and the group quantizer low-rank reuses.

A tensor is flattened and cut into blocks of `block_size` elements (the last may be short).
Each block keeps one fp32 scale s = max|x| and integer codes q = round(x / s · L) with
L = 127 (8 bits) or L = 7 (4 bits); decoding gives x̂ = q · s / L. Per element the error is at
most s / (2L), so an outlier only coarsens its own block. With a random generator the sender
rounds stochastically instead, q = ⌊x / s · L + u⌋ with u uniform in [0, 1): E[x̂] = x, the
error below s / L; a value sent round after round then is not pulled to the same code each
time (NoLoCo's θ, benchmarks/NOTEBOOK.md, "NoLoCo against DiLoCo and local-only"). The wire format
is the same.

Description: {"codec": "blockwise", "shape": [...], "bits": 8|4, "block": int}.
Payload: nblocks fp32 scales, then the codes: int8 per element (8 bits), or two 4-bit codes
per byte stored as q + 8 (element 2i in the low nibble, 2i+1 in the high one; an odd count
leaves one padding nibble). The codes −128 (8 bits) and −8 (4 bits) are never produced and
are refused on decode.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from protocol.codecs.base import Codec, DescriptionReader, Encoded, integer_parameter, payload_view, \
    register_codec, tensor_from_bytes, tensor_to_bytes
from protocol.errors import CodecError

SUPPORTED_BITS = (4, 8)
MAX_BLOCK_SIZE = 1 << 20
_LEVELS = {8: 127, 4: 7}
_KEYS = frozenset({"codec", "shape", "bits", "block"})


# ------------------------------------------------------------------ group quantizer (shared)
def quantize_groups(groups: torch.Tensor, bits: int, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax quantization of a 2-D fp32 tensor: (scales [rows], codes int8 [rows, cols]);
    rounded to nearest, or stochastically with `generator` (on the tensor's device)."""
    levels = _LEVELS[bits]
    scales = groups.abs().amax(dim=1) if groups.shape[1] \
        else torch.zeros(groups.shape[0], device=groups.device)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = groups / safe[:, None] * levels
    if generator is None:
        codes = torch.round(scaled)
    else:
        codes = torch.floor(scaled.add_(torch.rand(scaled.shape, generator=generator,
                                                   device=scaled.device)))
    return scales, codes.clamp_(-levels, levels).to(torch.int8)


def dequantize_groups(scales: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `quantize_groups`: codes · scale / L per row, in fp32."""
    return codes.to(torch.float32) * (scales / _LEVELS[bits])[:, None]


def packed_length(count: int, bits: int) -> int:
    """Bytes that `count` codes take at `bits` bits each."""
    return count if bits == 8 else (count + 1) // 2


def payload_length(count: int, bits: int, block: int) -> int:
    """Bytes of the payload of `count` elements: a fp32 scale a block, then the packed codes."""
    return 4 * -(-count // block) + packed_length(count, bits)


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Flat int8 codes to wire bytes (see the module docstring for the layout)."""
    return tensor_to_bytes(packed_codes(codes, bits))


def packed_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_codes`'s bytes as a uint8 tensor, where the codes lie."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.view(torch.uint8)
    offset = (flat.to(torch.int16) + 8).to(torch.uint8)
    if offset.numel() % 2:
        offset = torch.cat([offset, torch.tensor([8], dtype=torch.uint8, device=offset.device)])
    pairs = offset.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_codes(view: memoryview, count: int, bits: int, codec: str,
                 device: torch.device | None = None) -> torch.Tensor:
    """Wire bytes (length already validated) to `count` flat int8 codes on `device` (default the
    host); refuses unused codes."""
    raw = tensor_from_bytes(view, torch.uint8, device)
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
    """fp32 scales from the wire, on the host; each must be finite and >= 0. Checked in numpy,
    on one core: torch's small host operations wait on all of them, which a GPU node's other
    threads keep busy."""
    scales = np.frombuffer(view, dtype=np.float32).copy()
    if not (np.isfinite(scales) & (scales >= 0)).all():
        raise CodecError(f"{codec} payload holds a negative or non-finite scale.")
    return torch.from_numpy(scales)


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
        return Encoded(self.layout(tuple(values.shape))[0], tensor_to_bytes(self.payload_tensor(values)))

    def layout(self, shape: tuple[int, ...], name: str = "") -> tuple[dict[str, Any], int]:
        description = {"codec": self.name, "shape": list(shape), "bits": self.bits,
                       "block": self.block_size}
        return description, payload_length(math.prod(shape), self.bits, self.block_size)

    def payload_tensor(self, values: torch.Tensor, generator: torch.Generator | None = None
                       ) -> torch.Tensor:
        """The payload of finite fp32 `values` as a uint8 tensor where they lie (scales, then
        codes): a caller on a GPU copies many of them to the host in one buffer. `generator`:
        stochastic rounding (see the module docstring)."""
        flat = values.reshape(-1)
        count, block = flat.numel(), self.block_size
        blocks = -(-count // block)
        padded = torch.nn.functional.pad(flat, (0, blocks * block - count))
        scales, codes = quantize_groups(padded.reshape(blocks, block), self.bits, generator)
        return torch.cat([scales.contiguous().view(torch.uint8),
                          packed_codes(codes.reshape(-1)[:count], self.bits)])

    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        return self._decode_on(description, payload, max_elements, None)

    def _decode_on(self, description: Any, payload: Any, max_elements: int,
                   device: torch.device | None) -> torch.Tensor:
        # The codes cross to `device` as they came (a byte each) and are checked and scaled
        # there: on a GPU node that is milliseconds, where the host's cores are busy feeding it
        # (two daemons on one H100 took 5 s a snapshot decoding it on the host). The scales,
        # one in 64 elements, are read and divided on the host, in numpy (read_scales).
        reader = DescriptionReader(description, self.decodes, _KEYS)
        shape = reader.shape(max_elements)
        bits = reader.choice("bits", SUPPORTED_BITS)
        block = reader.integer("block", 1, MAX_BLOCK_SIZE)
        count = 1
        for dim in shape:
            count *= dim
        blocks = -(-count // block)
        view = payload_view(payload, payload_length(count, bits, block), self.name)
        # s / L on the host: a GPU divides by a scalar through its reciprocal, and a decoded
        # value must not depend on where it was decoded (x̂ = q · step is one rounding anywhere)
        scales = read_scales(view[:4 * blocks], self.name).numpy()
        step = torch.from_numpy(scales / np.float32(_LEVELS[bits])).to(device or "cpu")
        codes = unpack_codes(view[4 * blocks:], count, bits, self.name, device)
        # Full blocks as rows, then the short last one: nothing larger than `count` elements is
        # allocated, and no per-element index (8 bytes an element) either.
        values = codes.to(torch.float32)
        full = count // block
        values[:full * block].view(full, block).mul_(step[:full, None])
        if count > full * block:
            values[full * block:].mul_(step[full])
        return values.reshape(shape)
