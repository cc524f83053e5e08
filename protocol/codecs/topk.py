"""Chunked top-k with few-bit values and packed indices (SparseLoCo style, arXiv 2508.15706).

A tensor is flattened and cut into chunks of `chunk` elements (the last may be short; 4096 =
one 64×64 tile's worth). Each chunk j sends its k_j = min(k, len_j) largest-magnitude entries:

    I_j = top-k_j(|x_j|)  (ascending)     lo_j = min |x_j[I_j]| ,  hi_j = max |x_j[I_j]|
    code = sign bit | magnitude level m << 1,  m = ⌊(|x| − lo) / (hi − lo) · L⌋ ∈ [0, L),  L = 2^(bits−1)
    x̂[I_j] = ± (lo + (hi − lo) · (m + ½) / L) ;  x̂ = 0 elsewhere

i.e. a uniform quantizer over the range of the magnitudes kept (they all sit above the chunk's
k-th largest, so a range from 0 would waste most levels). Indices take ⌈log₂ chunk⌉ bits (12
at 4096). What is not sent, and the quantization error, stay in the caller's error feedback
(protocol/dilocox.py). `Encoded.energy_kept` is ‖x[I]‖²/‖x‖² before quantization, the number
the controller reads.

Description: {"codec": "topk", "shape": [...], "chunk": C, "k": k, "bits": 2|4|8}. The payload's
length follows from these alone (`payload_length`), so a message's size is known before it is
read. Payload: per chunk lo and hi (fp32), then every chunk's indices in order, then every
value code, both bit-packed LSB first (numpy.packbits, little bit order), unused trailing
bits zero. Decoding refuses an index outside its chunk, indices not strictly increasing within
a chunk (a repeat would count one coordinate twice), lo > hi, and set padding bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from protocol.codecs.base import Codec, DescriptionReader, Encoded, integer_parameter, payload_view, \
    register_codec, tensor_to_bytes
from protocol.codecs.blockwise import read_scales
from protocol.errors import CodecError

VALUE_BITS = (2, 4, 8)
MAX_CHUNK = 1 << 16  # indices fit 16 bits
_KEYS = frozenset({"codec", "shape", "chunk", "k", "bits"})


def index_bits(chunk: int) -> int:
    """Bits of one index within a chunk of `chunk` elements (at least 1)."""
    return max(1, math.ceil(math.log2(chunk)))


def selected_count(count: int, chunk: int, k: int) -> int:
    """Entries sent for a tensor of `count` elements: Σ_j min(k, len_j) over its chunks."""
    full, last = divmod(count, chunk)
    return full * min(k, chunk) + min(k, last)


def payload_length(count: int, chunk: int, k: int, bits: int) -> int:
    """Exact payload bytes for these description fields (no payload needed)."""
    chunks, selected = -(-count // chunk), selected_count(count, chunk, k)
    return 8 * chunks + packed_bits_length(selected, index_bits(chunk)) + packed_bits_length(selected, bits)


def packed_bits_length(count: int, width: int) -> int:
    return (count * width + 7) // 8


def pack_bits(values: torch.Tensor, width: int) -> bytes:
    """Non-negative ints < 2**width, `width` bits each, LSB first."""
    bits = (values.to(torch.int32)[:, None] >> torch.arange(width, dtype=torch.int32)) & 1
    return np.packbits(bits.to(torch.uint8).numpy().reshape(-1), bitorder="little").tobytes()


def unpack_bits(view: memoryview, count: int, width: int, codec: str) -> torch.Tensor:
    """Inverse of `pack_bits` (length already validated); refuses set padding bits."""
    raw = np.frombuffer(view, dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little")
    if bits[count * width:].any():
        raise CodecError(f"{codec} payload has set padding bits after its packed fields.")
    bits = bits[:count * width].reshape(count, width)
    values = np.zeros(count, dtype=np.int32)
    for position in range(width):  # one column at a time: no count × width int temporaries
        values |= bits[:, position].astype(np.int32) << position
    return torch.from_numpy(values)


@register_codec
class TopKCodec(Codec):
    """Top-k per chunk; k per tensor name (the controller's handle), chunk and bits shared."""

    name = "topk"
    decodes = ("topk",)

    def __init__(self, k: int = 64, chunk: int = 4096, bits: int = 2) -> None:
        self.chunk = integer_parameter(chunk, "topk chunk", 1, MAX_CHUNK)
        self.default_k = integer_parameter(k, "topk k", 1, self.chunk)
        self.bits = bits
        self._k: dict[str, int] = {}

    @property
    def bits(self) -> int:
        """Bits of each value code (a sign bit and bits − 1 magnitude bits)."""
        return self._bits

    @bits.setter
    def bits(self, bits: int) -> None:
        if type(bits) is not int or bits not in VALUE_BITS:
            raise CodecError(f"topk bits must be one of {list(VALUE_BITS)}, got {bits!r}.")
        self._bits = bits

    def k_of(self, name: str) -> int:
        return self._k.get(name, self.default_k)

    def set_k(self, name: str, k: int) -> None:
        self._k[name] = integer_parameter(k, f"topk k of {name!r}", 1, self.chunk)

    @property
    def density(self) -> float:
        """k / chunk of the default k: the share of coordinates a message carries."""
        return self.default_k / self.chunk

    def params(self) -> dict[str, Any]:
        return {"k": self.default_k, "chunk": self.chunk, "bits": self.bits}

    # ------------------------------------------------------------------ encode
    def _encode(self, values: torch.Tensor, name: str) -> Encoded:
        flat, chunk, k = values.reshape(-1), self.chunk, self.k_of(name)
        count, levels = flat.numel(), 1 << (self.bits - 1)
        description = self.layout(tuple(values.shape), name)[0]
        if count == 0:
            return Encoded(description, b"", energy_kept=1.0)
        chunks = -(-count // chunk)
        padded = torch.nn.functional.pad(flat, (0, chunks * chunk - count)).reshape(chunks, chunk)
        magnitude = padded.abs()
        magnitude.reshape(-1)[count:] = -1.0  # padding is never among the top k of a chunk
        top = torch.topk(magnitude, min(k, chunk), dim=1).indices.sort(dim=1).values
        keep = top < (count - torch.arange(chunks)[:, None] * chunk)  # drops the short chunk's padding
        chunk_of = torch.arange(chunks)[:, None].expand_as(top)[keep]
        index = top[keep]
        kept = padded[chunk_of, index]
        low = torch.full((chunks,), math.inf).scatter_reduce(0, chunk_of, kept.abs(), "amin")
        high = torch.zeros(chunks).scatter_reduce(0, chunk_of, kept.abs(), "amax")
        span = (high - low)[chunk_of]
        level = torch.where(span > 0, (kept.abs() - low[chunk_of]) / torch.where(span > 0, span, 1.0)
                            * levels, torch.zeros_like(kept)).floor().clamp_(0, levels - 1)
        codes = level.to(torch.int32) << 1 | (kept < 0).to(torch.int32)
        scales = torch.stack([low, high], dim=1)
        payload = (tensor_to_bytes(scales) + pack_bits(index, index_bits(chunk))
                   + pack_bits(codes, self.bits))
        total = float(flat.square().sum())
        energy = min(1.0, float(kept.square().sum()) / total) if total > 0 else 1.0
        return Encoded(description, payload, energy_kept=energy)

    def layout(self, shape: tuple[int, ...], name: str = "") -> tuple[dict[str, Any], int]:
        description = {"codec": self.name, "shape": list(shape), "chunk": self.chunk,
                       "k": self.k_of(name), "bits": self.bits}
        return description, payload_length(math.prod(shape), self.chunk, self.k_of(name), self.bits)

    # ------------------------------------------------------------------ decode
    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        reader = DescriptionReader(description, self.decodes, _KEYS)
        shape = reader.shape(max_elements)
        chunk = reader.integer("chunk", 1, MAX_CHUNK)
        k = reader.integer("k", 1, chunk)
        bits = reader.choice("bits", VALUE_BITS)
        count = math.prod(shape)
        chunks, selected = -(-count // chunk), selected_count(count, chunk, k)
        width = index_bits(chunk)
        view = payload_view(payload, payload_length(count, chunk, k, bits), self.name)
        index_bytes = packed_bits_length(selected, width)
        scales = read_scales(view[:8 * chunks], self.name).reshape(chunks, 2)
        if bool((scales[:, 0] > scales[:, 1]).any()):
            raise CodecError(f"{self.name} payload has a chunk whose smallest kept magnitude "
                             "exceeds its largest.")
        index = unpack_bits(view[8 * chunks:8 * chunks + index_bytes], selected, width, self.name)
        codes = unpack_bits(view[8 * chunks + index_bytes:], selected, bits, self.name)
        chunk_of = self._chunk_of_entries(count, chunk, k)
        length = torch.clamp(count - chunk_of * chunk, max=chunk)
        if bool((index >= length).any()):
            raise CodecError(f"{self.name} payload has an index outside its chunk.")
        if selected > 1 and bool(((index[1:] <= index[:-1]) & (chunk_of[1:] == chunk_of[:-1])).any()):
            raise CodecError(f"{self.name} payload has indices that are not strictly increasing "
                             "within a chunk.")
        low, high = scales[chunk_of, 0], scales[chunk_of, 1]
        levels = 1 << (bits - 1)
        magnitude = low + (high - low) * ((codes >> 1).to(torch.float32) + 0.5) / levels
        values = torch.where((codes & 1).bool(), -magnitude, magnitude)
        out = torch.zeros(count)
        out[chunk_of * chunk + index.to(torch.int64)] = values
        return out.reshape(shape)

    @staticmethod
    def _chunk_of_entries(count: int, chunk: int, k: int) -> torch.Tensor:
        """The chunk each sent entry belongs to, in payload order."""
        full, last = divmod(count, chunk)
        per_chunk = torch.full((full + (1 if last else 0),), min(k, chunk), dtype=torch.int64)
        if last:
            per_chunk[-1] = min(k, last)
        return torch.repeat_interleave(torch.arange(per_chunk.numel()), per_chunk)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"k": dict(self._k), "bits": self.bits}

    def load_state_dict(self, state: Any) -> None:
        try:
            ks, bits = state["k"], state["bits"]
        except (KeyError, TypeError) as missing:
            raise CodecError(f"topk state lacks the field {missing}.") from None
        self.bits = bits
        self._k = {}
        for name, k in dict(ks).items():
            self.set_k(name, k)
