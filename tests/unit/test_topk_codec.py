"""The top-k codec (protocol/codecs/topk.py): what it keeps, its exact size, and what it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.codecs import CodecError, decode, get_codec
from protocol.codecs.topk import index_bits, pack_bits, payload_length, selected_count

GENERATOR = torch.Generator().manual_seed(0)


def test_keeps_the_k_largest_of_every_chunk_and_nothing_else() -> None:
    tensor = torch.randn(3 * 64 + 10, generator=GENERATOR)
    codec = get_codec("topk", k=5, chunk=64, bits=8)
    encoded = codec.encode(tensor)
    decoded = codec.decode(encoded.description, encoded.payload)
    for start in range(0, tensor.numel(), 64):
        part, out = tensor[start:start + 64], decoded[start:start + 64]
        expected = set(part.abs().topk(min(5, part.numel())).indices.tolist())
        assert set(out.nonzero().reshape(-1).tolist()) == expected
        kept = part[list(expected)]
        # 8 bits: 7 magnitude bits over [lo, hi], the sign exact
        assert torch.equal(out[list(expected)].sign(), kept.sign())
        span = float(kept.abs().max() - kept.abs().min())
        assert float((out[list(expected)] - kept).abs().max()) <= span / 128 / 2 + 1e-6
    assert encoded.energy_kept == pytest.approx(float(decoded.square().sum() / tensor.square().sum()),
                                                rel=0.05)


def test_payload_length_is_known_from_the_description_alone() -> None:
    for shape, chunk, k, bits in [((4096,), 4096, 64, 2), ((192, 512), 4096, 64, 2),
                                  ((7,), 4, 3, 4), ((0,), 16, 2, 8), ((), 8, 8, 2)]:
        encoded = get_codec("topk", k=k, chunk=chunk, bits=bits).encode(torch.randn(shape))
        assert len(encoded.payload) == payload_length(math.prod(shape), chunk, k, bits)
    # the production point: 64 of 4096 with 2-bit values and 12-bit indices
    assert index_bits(4096) == 12
    assert payload_length(4096, 4096, 64, 2) == 8 + 64 * 12 // 8 + 64 * 2 // 8
    assert selected_count(4096 + 10, 4096, 64) == 74


def test_two_bit_values_with_error_feedback_send_everything_eventually() -> None:
    """What a round does not send waits in the residual: the sum of what was sent and the
    residual equals the sum of the inputs, and the residual stays bounded."""
    codec = get_codec("topk", k=16, chunk=256, bits=2)
    residual, sent, total = torch.zeros(1024), torch.zeros(1024), torch.zeros(1024)
    for _ in range(40):
        delta = torch.randn(1024, generator=GENERATOR)
        total += delta
        target = residual + delta
        encoded = codec.encode(target)
        decoded = codec.decode(encoded.description, encoded.payload)
        residual, sent = target - decoded, sent + decoded
    torch.testing.assert_close(sent + residual, total, rtol=0, atol=1e-4)
    assert float(residual.norm()) < 0.9 * float(total.norm())


def _valid(shape=(2, 8), chunk: int = 8, k: int = 3, bits: int = 2):
    encoded = get_codec("topk", k=k, chunk=chunk, bits=bits).encode(torch.randn(shape, generator=GENERATOR))
    return dict(encoded.description), bytearray(encoded.payload)


def _with_indices(indices: list[int], chunk: int = 8, k: int = 3, bits: int = 2) -> tuple[dict, bytes]:
    """A payload for one chunk of `chunk` elements with these indices and zero scales."""
    description = {"codec": "topk", "shape": [chunk], "chunk": chunk, "k": k, "bits": bits}
    payload = b"\0" * 8 + pack_bits(torch.tensor(indices), index_bits(chunk)) + \
        pack_bits(torch.zeros(k, dtype=torch.int32), bits)
    return description, payload


@pytest.mark.parametrize("indices, reason", [
    ([0, 3, 3], "strictly increasing"), ([5, 2, 7], "strictly increasing")])
def test_refuses_repeated_or_unordered_indices(indices: list[int], reason: str) -> None:
    description, payload = _with_indices(indices)
    with pytest.raises(CodecError, match=reason):
        decode(description, payload)
    assert decode(*_with_indices([0, 3, 7])).count_nonzero() == 0  # the same, well-formed


def test_refuses_an_index_outside_a_short_last_chunk() -> None:
    description = {"codec": "topk", "shape": [5], "chunk": 8, "k": 3, "bits": 2}
    payload = b"\0" * 8 + pack_bits(torch.tensor([0, 1, 6]), 3) + pack_bits(torch.zeros(3, dtype=torch.int32), 2)
    with pytest.raises(CodecError, match="outside its chunk"):
        decode(description, payload)


@pytest.mark.parametrize("edit, reason", [
    (lambda d, p: (dict(d, k=6), p), "payload is"),             # counts that do not match
    (lambda d, p: (dict(d, k=9), p), "outside"),               # k above the chunk
    (lambda d, p: (d, p + b"\0"), "payload is"),
    (lambda d, p: (d, p[:-1]), "payload is"),
    (lambda d, p: (d, p[:-1] + b"\xff"), "padding bits|strictly"),
    (lambda d, p: (d, bytes([0, 0, 0x80, 0x7f]) + p[4:]), "non-finite"),  # lo = +inf
])
def test_refuses_inconsistent_messages_with_a_reason(edit, reason: str) -> None:
    description, payload = edit(*_valid())
    with pytest.raises(CodecError, match=reason):
        decode(description, bytes(payload))


def test_refuses_lo_above_hi() -> None:
    description, payload = _valid(shape=(8,))
    payload[0:8] = torch.tensor([2.0, 1.0]).numpy().tobytes()
    with pytest.raises(CodecError, match="smallest kept magnitude"):
        decode(description, bytes(payload))


def test_k_per_tensor_and_state_round_trip() -> None:
    codec = get_codec("topk", k=4, chunk=64, bits=2)
    codec.set_k("w", 16)
    assert codec.encode(torch.randn(64), "w").description["k"] == 16
    assert codec.encode(torch.randn(64), "v").description["k"] == 4
    other = get_codec("topk", k=4, chunk=64, bits=2)
    other.load_state_dict(codec.state_dict())
    assert other.k_of("w") == 16
    with pytest.raises(CodecError, match="k of"):
        codec.set_k("w", 65)
