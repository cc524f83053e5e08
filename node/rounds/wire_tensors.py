"""Named torch tensors <-> the network layer's raw tensors (p2p/messages.py), in one place.

Tensors travel as (name, dtype, shape, bytes); bfloat16 travels as its raw 16-bit patterns.
Decoding copies into fresh fp32 tensors, so nothing received aliases a network buffer.

Quantized wire dtypes ("int8", "int4"; `QUANTIZED_BITS`) send each tensor as one flat uint8
tensor: the blockwise absmax payload of protocol/codecs/blockwise.py with blocks of
`QUANT_BLOCK` = 64 elements, ⌈n/64⌉ fp32 scales s = max|x| of each block, then the codes
q = round(x/s·L) (L = 127 at 8 bits, one byte each; L = 7 at 4 bits, two to a byte), so

    bytes(n) = 4·⌈n/64⌉ + n            (int8: 1.0625 bytes a parameter)
    bytes(n) = 4·⌈n/64⌉ + ⌈n/2⌉        (int4: 0.5625 bytes a parameter)

and decoding gives x̂ = q·s/L, off by at most s/(2L) per element (the rounding of q) plus
fp32 arithmetic (relative 2^-23); with `protocol.wire_rounding = "stochastic"` the sender
rounds q = ⌊x/s·L + u⌋, u uniform in [0, 1) from its own generator: unbiased, off by less
than s/L (protocol/codecs/blockwise.py). Scales travel in fp32, not fp16: fp16 would save 2/64 =
0.031 bytes a parameter (2.9% of an int8 message, 5.6% of an int4 one) but add up to 2^-11·s
per element (12% of the int8 bound), overflow for a block beyond 65504 and lose relative
precision below 6.1e-5; in fp32 each tensor's bytes are exactly the `blockwise` codec's
payload, so its bounded, fuzzed decoder is reused whole.
Nothing on the wire describes a quantized tensor: its bits, block and shape follow from the
manifest and the receiver's own tensor of that name, so every byte count is known before a
byte is read, and a tensor whose name, dtype or length differs is refused before any decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np
import torch

from p2p.messages import OutgoingTensor
from protocol.codecs.blockwise import BlockwiseCodec, pack_codes, packed_length
from protocol.errors import CodecError

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_OF_WIRE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WIRE_OF_TORCH = {v: k for k, v in TORCH_OF_WIRE.items()}
QUANTIZED_BITS = {"int8": 8, "int4": 4}
QUANT_BLOCK = 64
"""Elements per absmax block of a quantized wire dtype (one fp32 scale each)."""


def tensor_wire_bytes(count: int, dtype: str) -> int:
    """Exact bytes one tensor of `count` elements takes on the wire in `dtype` (formula above)."""
    if dtype in QUANTIZED_BITS:
        return 4 * -(-count // QUANT_BLOCK) + packed_length(count, QUANTIZED_BITS[dtype])
    return count * torch.empty(0, dtype=WIRE_DTYPES[dtype]).element_size()


def _rounding_variance(t: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, v): the tensor's elements and the variance bound of each one's rounding in `dtype`,
    broadcastable to x: for a quantized dtype x in blocks of QUANT_BLOCK (zero-padded) and
    (s/L)²/4 a block of absmax s (stochastic rounding; to nearest, (s/L)²/12); relative 2^-8 of
    each element in bf16 (2^-11 fp16); 0 in fp32."""
    flat = t.detach().float().reshape(-1)
    if dtype in QUANTIZED_BITS:
        levels = 2 ** (QUANTIZED_BITS[dtype] - 1) - 1
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % QUANT_BLOCK)).reshape(-1, QUANT_BLOCK)
        return blocks, (blocks.abs().amax(dim=1, keepdim=True) / levels).pow(2) / 4
    relative = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}.get(dtype, 0.0)
    return flat, (relative * flat).pow(2)


class RoundingErrors(NamedTuple):
    """How far tensors sent in a wire dtype typically arrive from what was sent (`rounding_errors`)."""

    norm: float    # all of it: the root of the summed per-element variance bounds
    along: float   # its part along each tensor's own direction


def rounding_errors(tensors: Mapping[str, torch.Tensor], dtype: str) -> RoundingErrors:
    """Both in one pass over the tensors (`_rounding_variance` gives each element's bound v_k):
    norm = √(Σ_k v_k), what two honest snapshots of one model differ by on the wire alone
    (protocol/pull_bound.py's floor f); along = the root of the summed variance bound of
    ⟨x̂_t − x_t, x_t⟩/‖x_t‖ over tensors t, Σ_k v_k·x_k²/‖x_t‖², about norm/√(elements a
    tensor) since the rounding is independent between elements (the radial floor f_ρ)."""
    total, along = 0.0, 0.0
    for t in tensors.values():
        x, v = _rounding_variance(t, dtype)
        total += float(v.expand_as(x).sum())
        squared = float(x.pow(2).sum())
        if squared > 0.0:
            along += float((v * x.pow(2)).sum()) / squared
    return RoundingErrors(math.sqrt(total), math.sqrt(along))


def rounding_error_norm(tensors: Mapping[str, torch.Tensor], dtype: str) -> float:
    return rounding_errors(tensors, dtype).norm


def rounding_error_along(tensors: Mapping[str, torch.Tensor], dtype: str) -> float:
    return rounding_errors(tensors, dtype).along


def to_wire(tensors: Mapping[str, torch.Tensor], dtype: str, prefix: str = "",
            rounding: torch.Generator | None = None) -> list[OutgoingTensor]:
    """Casts to the wire dtype, or quantizes, where the tensors are (on a GPU, only the wire's
    bytes cross to the host); `rounding`: a quantized dtype rounds stochastically with it."""
    if dtype in QUANTIZED_BITS:
        return _to_wire_quantized(tensors, QUANTIZED_BITS[dtype], prefix, rounding)
    torch_dtype = WIRE_DTYPES[dtype]
    out = []
    for name, tensor in tensors.items():
        cast = tensor.detach().to(torch_dtype).to("cpu").contiguous()
        out.append(OutgoingTensor(prefix + name, WIRE_OF_TORCH[torch_dtype], tuple(cast.shape),
                                  cast.reshape(-1).view(torch.uint8).numpy()))
    return out


def _to_wire_quantized(tensors: Mapping[str, torch.Tensor], bits: int, prefix: str,
                       rounding: torch.Generator | None) -> list[OutgoingTensor]:
    """One uint8 tensor a tensor: the blockwise payload, encoded where the tensors lie and
    copied into one host buffer that the message's tensors view (the host holds the message's
    bytes once; the GPU is waited on once for all the finiteness checks). A tensor holding NaN
    or ±inf (a node whose training diverged) sends NaN scales and zero codes, of the same
    length: its receiver refuses it, as it refuses a NaN sent in bf16, and this round goes on."""
    codec = BlockwiseCodec(bits, QUANT_BLOCK)
    values = {name: t.detach().to(torch.float32).contiguous() for name, t in tensors.items()}
    finite = torch.stack([torch.isfinite(v).all() for v in values.values()]).tolist() if values else []
    sizes = [4 * -(-v.numel() // QUANT_BLOCK) + packed_length(v.numel(), bits) for v in values.values()]
    host = torch.empty(sum(sizes), dtype=torch.uint8)
    out, offset = [], 0
    for (name, v), ok, size in zip(values.items(), finite, sizes):
        part = host[offset:offset + size]
        if ok:
            part.copy_(codec.payload_tensor(v, rounding))
        else:
            scales = np.full(-(-v.numel() // QUANT_BLOCK), np.nan, dtype=np.float32).tobytes()
            data = scales + pack_codes(torch.zeros(v.numel(), dtype=torch.int8), bits)
            part.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        out.append(OutgoingTensor(prefix + name, "uint8", (size,), part.numpy()))
        offset += size
    return out


def from_wire(received, prefix: str = "", share: bool = False,
              device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a ReceivedMessage whose names start with `prefix`, as fp32 copies (on
    `device` if given: the wire's bytes cross and are widened there).

    `share`: fp32 tensors are views of the message's own (writable) buffer instead of copies, so
    that a model-sized message is held once, not twice (a `medium` late-join state: 10.8 GB);
    only for a caller that copies out of them and never writes into them (node/rounds/state.py).
    Only the float dtypes above are accepted; the network layer already checked every size.
    """
    result = {}
    for full_name, (entry, view) in received.tensor_views().items():
        if not full_name.startswith(prefix):
            continue
        if entry.dtype not in TORCH_OF_WIRE:
            raise ValueError(f"tensor {full_name} arrived as {entry.dtype}, not a float dtype")
        source = view if share and not view.readonly else bytearray(view)
        raw = torch.frombuffer(source, dtype=TORCH_OF_WIRE[entry.dtype])
        raw = raw.view(entry.shape) if device is None else raw.view(entry.shape).to(device)
        result[full_name[len(prefix):]] = raw.to(torch.float32)
    return result


def from_wire_quantized(received, dtype: str, shapes: Mapping[str, tuple[int, ...]],
                        prefixes: Iterable[str], device: torch.device | None = None
                        ) -> dict[str, dict[str, torch.Tensor]]:
    """{prefix: {name: fp32 tensor}}: every prefix + name of `shapes`, quantized in `dtype`,
    decoded on `device` (default the host).

    The message must hold exactly those tensors, each uint8 of exactly `tensor_wire_bytes`;
    all of that is checked before anything is decoded, so nothing beyond those sizes is
    allocated. Then the blockwise decoder refuses negative or non-finite scales and the codes
    never produced (−128, −8). Any failure: ValueError, a clause naming the tensor.
    """
    prefixes, bits = list(prefixes), QUANTIZED_BITS[dtype]
    views = received.tensor_views()
    expected = {p + name: tuple(shape) for p in prefixes for name, shape in shapes.items()}
    missing, extra = sorted(expected.keys() - views.keys()), sorted(views.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"its tensors differ from ours: missing {_names(missing)}, "
                         f"unexpected {_names(extra)}")
    for full_name, shape in expected.items():
        entry, view = views[full_name]
        length = tensor_wire_bytes(math.prod(shape), dtype)
        if entry.dtype != "uint8" or tuple(entry.shape) != (length,) or view.nbytes != length:
            raise ValueError(f"tensor {full_name} arrived as {entry.dtype} {_short(entry.shape)} "
                             f"({view.nbytes} bytes), but protocol.wire_dtype = {dtype!r} sends "
                             f"its {math.prod(shape)} elements as uint8 ({length},)")
    codec = BlockwiseCodec(bits, QUANT_BLOCK)
    result: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    for prefix in prefixes:
        for name, shape in shapes.items():
            description = {"codec": codec.name, "shape": list(shape), "bits": bits,
                           "block": QUANT_BLOCK}
            try:
                result[prefix][name] = codec.decode(description, views[prefix + name][1],
                                                    max(1, math.prod(shape)), device)
            except CodecError as exc:
                raise ValueError(f"tensor {prefix}{name}: {str(exc).rstrip('.')}") from None
    return result


def _names(names: list[str]) -> str:
    """At most three names, each cut short: a hostile message cannot flood the sentence."""
    shown = [_short(name) for name in names[:3]]
    return "none" if not names else ", ".join(shown) + (f" and {len(names) - 3} more"
                                                         if len(names) > 3 else "")


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
