"""Low-rank codec, PowerSGD style (docs/protocols.md §3 "Compression"), with quantized factors.

A tensor of shape (rows, …) is viewed as a matrix M of rows × cols (cols = the product of the
other dimensions) and sent as M ≈ P·Qᵀ of rank k, by `iterations` warm-started power
iterations a round (1 by default, as PowerSGD):

    P = M·Q_prev ;  P ← orthonormal basis of P (torch.linalg.qr) ;  Q = Mᵀ·P   (then Q_prev ← Q)

Q is kept per tensor name as the next round's warm start (encoder state, `state_dict`), so the
subspace keeps improving across rounds. PowerSGD takes one iteration because each costs it an
all-reduce; here a node compresses its own message, so more iterations cost only its compute
(2·iterations products of M with a k-column matrix) and bring P·Qᵀ nearer the best rank-k
approximation (the truncated SVD), at the same bytes. Since P is orthonormal, the energy kept is
ε = ‖P·Qᵀ‖²/‖M‖² = ‖Q‖²/‖M‖², reported in `Encoded.energy_kept` for the controller.
P and Q are quantized to `bits` (8 or 4) with one absmax scale per column.

1-D tensors, tensors under `min_elements`, and tensors where rank k would not save bytes
(k·(rows + cols) ≥ rows·cols) fall back to blockwise 8-bit; their `energy_kept` is None.

Description: {"codec": "lowrank", "shape": [...], "rank": k, "bits": 8|4}.
Payload: k fp32 scales of P, k fp32 scales of Q, then P's codes column by column, then Q's
(each packed as in protocol/codecs/blockwise.py).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from protocol.codecs.base import Codec, DescriptionReader, Encoded, integer_parameter, payload_view, \
    register_codec, tensor_to_bytes
from protocol.codecs.blockwise import SUPPORTED_BITS, BlockwiseCodec, dequantize_groups, pack_codes, \
    packed_length, quantize_groups, read_scales, unpack_codes
from protocol.errors import CodecError

MAX_RANK = 4096
MAX_ITERATIONS = 16
_KEYS = frozenset({"codec", "shape", "rank", "bits"})
ROW_BLOCK = 32  # rows of P·Qᵀ a decoding pass keeps in cache (outer_sum)


def matrix_view_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the matrix a tensor of `shape` (2-D or more) is compressed as."""
    return shape[0], math.prod(shape[1:])


def payload_length(rows: int, cols: int, rank: int, bits: int) -> int:
    """Bytes of the payload of a rank-`rank` P·Qᵀ of a rows × cols matrix: 2·rank fp32 scales,
    then P's and Q's codes."""
    return 8 * rank + packed_length(rows * rank, bits) + packed_length(cols * rank, bits)


def outer_sum(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """P·Qᵀ from P's and Q's columns (`left` rank × rows, `right` rank × cols), in one fixed order:

        out[i, j] = ((left[0, i]·right[0, j] + left[1, i]·right[1, j]) + left[2, i]·right[2, j]) + …

    Every node must decode a message to the same bits (DiLoCoX agrees on φ bitwise, docs/protocols.md
    §3), and a matmul's order of summation and its fused multiply-adds depend on the BLAS and
    the CPU: MKL's default path and its reproducible one (MKL_CBWR=COMPATIBLE) decode the same
    message to different bits on one machine. Elementwise products and sums are rounded alike
    on any hardware; blocks of rows keep it near a matmul's speed for small ranks."""
    rank, rows = left.shape
    out = torch.empty(rows, right.shape[1], dtype=right.dtype)
    for start in range(0, rows, ROW_BLOCK):
        block = out[start:start + ROW_BLOCK]
        torch.mul(left[0, start:start + ROW_BLOCK, None], right[0], out=block)
        for k in range(1, rank):
            block.add_(left[k, start:start + ROW_BLOCK, None] * right[k])
    return out


@register_codec
class LowRankCodec(Codec):
    """Rank-k P·Qᵀ with per-column quantized factors; rank per tensor name, bits shared."""

    name = "lowrank"
    decodes = ("lowrank", "blockwise")

    def __init__(self, rank: int = 4, bits: int = 8, min_elements: int = 4096,
                 fallback_block_size: int = 64, seed: int = 0, iterations: int = 1) -> None:
        self.default_rank = integer_parameter(rank, "lowrank rank", 1, MAX_RANK)
        self.iterations = integer_parameter(iterations, "lowrank iterations", 1, MAX_ITERATIONS)
        self.bits = bits  # validated by the property setter
        self.min_elements = integer_parameter(min_elements, "lowrank min_elements", 0, 1 << 40)
        self.seed = integer_parameter(seed, "lowrank seed", 0, (1 << 32) - 1)
        self._fallback = BlockwiseCodec(bits=8, block_size=fallback_block_size)
        self._ranks: dict[str, int] = {}
        self._warm_start: dict[str, torch.Tensor] = {}  # name -> Q of the last round (cols × k)

    # ------------------------------------------------------------------ settings
    @property
    def bits(self) -> int:
        """Bits of the quantized factors P and Q (8 or 4)."""
        return self._bits

    @bits.setter
    def bits(self, bits: int) -> None:
        if type(bits) is not int or bits not in SUPPORTED_BITS:
            raise CodecError(f"lowrank bits must be one of {list(SUPPORTED_BITS)}, got {bits!r}.")
        self._bits = bits

    def rank_of(self, name: str) -> int:
        """The rank asked for tensor `name` (the effective rank is also capped by its shape)."""
        return self._ranks.get(name, self.default_rank)

    def set_rank(self, name: str, rank: int) -> None:
        """Ask for rank `rank` on tensor `name` from the next encode on (the warm start adapts)."""
        self._ranks[name] = integer_parameter(rank, f"lowrank rank of {name!r}", 1, MAX_RANK)

    @property
    def ranks(self) -> dict[str, int]:
        """Ranks set per tensor name (others use `default_rank`)."""
        return dict(self._ranks)

    def uses_low_rank(self, shape: tuple[int, ...] | torch.Size, name: str = "") -> bool:
        """Whether a tensor of `shape` is sent as P·Qᵀ (else as blockwise 8-bit)."""
        if len(shape) < 2 or math.prod(shape) < max(self.min_elements, 1):
            return False
        rows, cols = matrix_view_shape(tuple(shape))
        rank = min(self.rank_of(name), rows, cols)
        return rank * (rows + cols) < rows * cols

    def params(self) -> dict[str, Any]:
        return {"rank": self.default_rank, "bits": self.bits, "min_elements": self.min_elements,
                "fallback_block_size": self._fallback.block_size, "seed": self.seed,
                "iterations": self.iterations}

    # ------------------------------------------------------------------ encode
    def _encode(self, values: torch.Tensor, name: str) -> Encoded:
        if not self.uses_low_rank(values.shape, name):
            return self._fallback.encode(values, name)
        matrix, left, right = self._power_iterations(values, name)
        total = float(matrix.square().sum())
        energy = min(1.0, float(right.square().sum()) / total) if total > 0 else 1.0
        left_scales, left_codes = quantize_groups(left.T.contiguous(), self.bits)
        right_scales, right_codes = quantize_groups(right.T.contiguous(), self.bits)
        payload = (tensor_to_bytes(left_scales) + tensor_to_bytes(right_scales)
                   + pack_codes(left_codes, self.bits) + pack_codes(right_codes, self.bits))
        description = {"codec": self.name, "shape": list(values.shape), "rank": left.shape[1],
                       "bits": self.bits}
        return Encoded(description, payload, energy_kept=energy)

    def layout(self, shape: tuple[int, ...], name: str = "") -> tuple[dict[str, Any], int]:
        if not self.uses_low_rank(shape, name):
            return self._fallback.layout(shape, name)
        rows, cols = matrix_view_shape(tuple(shape))
        rank = min(self.rank_of(name), rows, cols)  # P's columns, as `_power_iterations` gives them
        description = {"codec": self.name, "shape": list(shape), "rank": rank, "bits": self.bits}
        return description, payload_length(rows, cols, rank, self.bits)

    def track(self, tensor: torch.Tensor, name: str = "") -> None:
        """A round not sent still turns the warm start: Q ← Mᵀ·orth(M·Q). A node that sends one
        round in many (a committee) otherwise starts from the subspace of its last send, rounds
        old, and keeps less of each message than a node that sends every round."""
        values = tensor.detach().to(dtype=torch.float32).contiguous()
        if self.uses_low_rank(values.shape, name) and bool(torch.isfinite(values).all()):
            self._power_iterations(values, name)

    def _power_iterations(self, values: torch.Tensor,
                          name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(M, P, Q) after `iterations` warm-started power iterations; Q becomes the next warm
        start."""
        rows, cols = matrix_view_shape(tuple(values.shape))
        rank = min(self.rank_of(name), rows, cols)
        matrix = values.reshape(rows, cols)
        right = self._start(name, cols, rank)
        for _ in range(self.iterations):
            left = torch.linalg.qr(matrix @ right).Q  # P, orthonormal columns
            right = matrix.T @ left                   # Q = Mᵀ·P
        self._warm_start[name] = right.clone()
        return matrix, left, right

    def _start(self, name: str, cols: int, rank: int) -> torch.Tensor:
        """Last round's Q for `name`, resized to `rank` columns; fresh seeded columns if needed."""
        previous = self._warm_start.get(name)
        if previous is not None and previous.shape[0] == cols and previous.shape[1] >= rank:
            return previous[:, :rank]
        generator = torch.Generator().manual_seed(self.seed ^ zlib.crc32(name.encode("utf-8")))
        fresh = torch.randn(cols, rank, generator=generator)
        if previous is not None and previous.shape[0] == cols:
            fresh[:, :previous.shape[1]] = previous  # keep the learnt subspace when k grows
        return fresh

    # ------------------------------------------------------------------ decode
    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        if isinstance(description, dict) and description.get("codec") == "blockwise":
            return self._fallback.decode(description, payload, max_elements)
        reader = DescriptionReader(description, ("lowrank",), _KEYS)
        shape = reader.shape(max_elements)
        if len(shape) < 2:
            raise CodecError(f"lowrank description shape {list(shape)} has fewer than 2 dimensions.")
        rows, cols = matrix_view_shape(shape)
        if rows * cols == 0:
            raise CodecError(f"lowrank description shape {list(shape)} is empty; empty tensors "
                             "are sent as blockwise.")
        rank = reader.integer("rank", 1, min(rows, cols, MAX_RANK))
        bits = reader.choice("bits", SUPPORTED_BITS)
        left_bytes = packed_length(rows * rank, bits)
        view = payload_view(payload, payload_length(rows, cols, rank, bits), self.name)
        left_scales = read_scales(view[:4 * rank], self.name)
        right_scales = read_scales(view[4 * rank:8 * rank], self.name)
        left_codes = unpack_codes(view[8 * rank:8 * rank + left_bytes], rows * rank, bits, self.name)
        right_codes = unpack_codes(view[8 * rank + left_bytes:], cols * rank, bits, self.name)
        left = dequantize_groups(left_scales, left_codes.reshape(rank, rows), bits)
        right = dequantize_groups(right_scales, right_codes.reshape(rank, cols), bits)
        return outer_sum(left, right).reshape(shape)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Warm starts and per-tensor ranks, so a restarted node keeps its subspaces."""
        return {"warm_start": {name: q.clone() for name, q in self._warm_start.items()},
                "ranks": dict(self._ranks), "bits": self.bits}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            warm_start, ranks, bits = state["warm_start"], state["ranks"], state["bits"]
        except (KeyError, TypeError) as missing:
            raise CodecError(f"lowrank state lacks the field {missing}.") from None
        if not isinstance(warm_start, Mapping) or not isinstance(ranks, Mapping):
            raise CodecError("lowrank state fields warm_start and ranks must be mappings by name.")
        for name, q in warm_start.items():
            if not isinstance(q, torch.Tensor) or q.dim() != 2:
                raise CodecError(f"lowrank warm start of {name!r} must be a 2-D tensor.")
        self.bits = bits
        self._ranks = {}
        for name, rank in ranks.items():
            self.set_rank(name, rank)
        self._warm_start = {name: q.detach().to(torch.float32).clone() for name, q in warm_start.items()}
