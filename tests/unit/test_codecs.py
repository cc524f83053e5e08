"""Codecs (protocol/codecs/): round trips, exact sizes, measured accuracy, low-rank state."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from protocol.codecs import CodecError, Encoded, LowRankCodec, codec_names, decode, get_codec

ALL_CODECS = [("identity", {}), ("fp16", {}), ("bf16", {}), ("blockwise", {"bits": 8}),
              ("blockwise", {"bits": 4, "block_size": 256}), ("lowrank", {"rank": 4, "bits": 8}),
              ("lowrank", {"rank": 2, "bits": 4, "min_elements": 16}),
              ("topk", {"k": 2, "chunk": 16, "bits": 2}), ("topk", {"k": 64, "bits": 4})]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (64, 48), (16, 3, 3, 3), (0, 4)]


def _relative_error(decoded: torch.Tensor, original: torch.Tensor) -> float:
    return float((decoded - original).norm() / original.norm())


@pytest.mark.parametrize("name, params", ALL_CODECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_keeps_shape_and_gives_fp32(name: str, params: dict, shape: tuple) -> None:
    codec = get_codec(name, **params)
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    encoded = codec.encode(tensor, name="t")
    for decoded in (codec.decode(encoded.description, encoded.payload), decode(encoded.description,
                                                                                encoded.payload)):
        assert decoded.shape == tensor.shape and decoded.dtype == torch.float32
    assert encoded.size_bytes == len(encoded.payload) + len(msgpack.packb(encoded.description))
    assert msgpack.unpackb(msgpack.packb(encoded.description)) == encoded.description
    assert codec.layout(shape, "t") == (encoded.description, len(encoded.payload))


@pytest.mark.parametrize("name, params", ALL_CODECS)
def test_a_layout_is_what_encode_gives_the_tensor_of_that_shape_and_name(name: str, params: dict) -> None:
    """A message's size is known before it is encoded (node/rounds/traffic.py sizes a round's
    exchange from it): with a rank or k set for one tensor name, and in the fallbacks."""
    codec = get_codec(name, **params)
    if name == "lowrank":
        codec.set_rank("wide", 3)
    if name == "topk":
        codec.set_k("wide", 1)
    for shape in [(96, 80), (5000,), (70, 65), (2, 3, 4)]:
        for tensor_name in ("wide", "other"):
            encoded = codec.encode(torch.randn(shape), tensor_name)
            assert codec.layout(shape, tensor_name) == (encoded.description, len(encoded.payload)), \
                (shape, tensor_name)


def test_identity_is_bitwise_and_payload_lengths_are_exact() -> None:
    tensor = torch.randn(1000)
    encoded = get_codec("identity").encode(tensor)
    assert torch.equal(get_codec("identity").decode(encoded.description, encoded.payload), tensor)
    assert len(encoded.payload) == 4000
    assert len(get_codec("bf16").encode(tensor).payload) == 2000
    assert len(get_codec("blockwise", bits=8, block_size=64).encode(tensor).payload) == 4 * 16 + 1000
    assert len(get_codec("blockwise", bits=4, block_size=64).encode(tensor).payload) == 4 * 16 + 500
    assert len(get_codec("blockwise", bits=4).encode(torch.randn(7)).payload) == 4 + 4


def _measure(name: str, params: dict, tensor: torch.Tensor, rounds: int = 1) -> tuple[float, float]:
    codec = get_codec(name, **params)
    for _ in range(rounds):  # low-rank: let the warm start settle on a fixed matrix
        encoded = codec.encode(tensor, name="w")
    decoded = codec.decode(encoded.description, encoded.payload)
    return _relative_error(decoded, tensor), tensor.numel() * 4 / encoded.size_bytes


_GENERATOR = torch.Generator().manual_seed(0)
GAUSSIAN = torch.randn(512, 512, generator=_GENERATOR)
# Student-t with 2 degrees of freedom (infinite variance): Z / sqrt(chi²₂ / 2).
HEAVY_TAILED = torch.randn(512, 512, generator=_GENERATOR) / torch.sqrt(
    torch.randn(2, 512, 512, generator=_GENERATOR).square().mean(dim=0))
LOW_RANK = (torch.randn(512, 8, generator=_GENERATOR) @ torch.randn(8, 512, generator=_GENERATOR)
            / math.sqrt(8) + 0.05 * torch.randn(512, 512, generator=_GENERATOR))

# (codec, params, data, largest relative error, smallest fp32/encoded size ratio): measured
# values sit well inside these bounds (see the printed table, pytest -s).
ACCURACY_BOUNDS = [
    ("identity", {}, "gaussian", 0.0, 0.99), ("identity", {}, "student_t2", 0.0, 0.99),
    ("fp16", {}, "gaussian", 5e-4, 1.99), ("fp16", {}, "student_t2", 5e-4, 1.99),
    ("bf16", {}, "gaussian", 4e-3, 1.99), ("bf16", {}, "student_t2", 4e-3, 1.99),
    ("blockwise", {"bits": 8, "block_size": 64}, "gaussian", 0.01, 3.7),
    ("blockwise", {"bits": 8, "block_size": 64}, "student_t2", 0.025, 3.7),
    ("blockwise", {"bits": 8, "block_size": 256}, "gaussian", 0.01, 3.9),
    ("blockwise", {"bits": 8, "block_size": 256}, "student_t2", 0.04, 3.9),
    ("blockwise", {"bits": 4, "block_size": 64}, "gaussian", 0.13, 7.0),
    ("blockwise", {"bits": 4, "block_size": 64}, "student_t2", 0.25, 7.0),
    ("blockwise", {"bits": 4, "block_size": 256}, "gaussian", 0.15, 7.7),
    ("blockwise", {"bits": 4, "block_size": 256}, "student_t2", 0.35, 7.7),
    # Full-rank noise cannot be kept at rank 8: the error is ~1 and is what error feedback
    # carries to later rounds; on a rank-8 matrix plus noise it is small.
    ("lowrank", {"rank": 8, "bits": 8}, "gaussian", 1.0, 120.0),
    ("lowrank", {"rank": 8, "bits": 8}, "student_t2", 1.0, 120.0),
    ("lowrank", {"rank": 8, "bits": 8}, "low_rank", 0.07, 120.0),
    ("lowrank", {"rank": 8, "bits": 4}, "low_rank", 0.25, 240.0),
]
DATA = {"gaussian": GAUSSIAN, "student_t2": HEAVY_TAILED, "low_rank": LOW_RANK}


@pytest.mark.parametrize("name, params, data, max_error, min_ratio", ACCURACY_BOUNDS)
def test_measured_error_and_size(name: str, params: dict, data: str, max_error: float,
                                 min_ratio: float) -> None:
    error, ratio = _measure(name, params, DATA[data], rounds=3 if name == "lowrank" else 1)
    print(f"\n{name} {params} on {data} 512x512: relative error {error:.4g}, "
          f"size ratio {ratio:.2f}x")
    assert error <= max_error and ratio >= min_ratio


def test_lowrank_energy_is_the_power_iteration_energy() -> None:
    matrix = LOW_RANK[:128, :96].contiguous()
    codec = LowRankCodec(rank=3)
    codec.encode(matrix, "w")
    warm_start = codec.state_dict()["warm_start"]["w"]
    encoded = codec.encode(matrix, "w")
    left = torch.linalg.qr(matrix @ warm_start).Q
    right = matrix.T @ left
    expected = float((left @ right.T).square().sum() / matrix.square().sum())
    assert encoded.energy_kept == pytest.approx(expected, rel=1e-4)


def test_lowrank_warm_start_converges_to_the_best_rank_k_energy() -> None:
    generator = torch.Generator().manual_seed(3)
    left = torch.linalg.qr(torch.randn(200, 6, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(150, 6, generator=generator)).Q
    singular_values = torch.tensor([10.0, 6.0, 2.0, 1.0, 0.5, 0.25])
    matrix = left @ torch.diag(singular_values) @ right.T
    best = float(singular_values[:2].square().sum() / singular_values.square().sum())
    codec = LowRankCodec(rank=2, bits=8)
    energies = [codec.encode(matrix, "w").energy_kept for _ in range(8)]
    assert energies[0] < energies[-1] <= best + 1e-6
    assert energies[-1] > 0.999 * best


def test_lowrank_more_power_iterations_come_nearer_the_best_rank_k_at_the_same_bytes() -> None:
    """One iteration from a cold start keeps well under the truncated SVD's energy; four keep
    nearly all of it, in a message of the same size, which any receiver decodes."""
    generator = torch.Generator().manual_seed(6)
    left = torch.linalg.qr(torch.randn(200, 8, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(150, 8, generator=generator)).Q
    singular_values = torch.tensor([10.0, 9.0, 8.0, 7.0, 3.0, 2.0, 1.0, 0.5])
    matrix = left @ torch.diag(singular_values) @ right.T
    best = float(singular_values[:2].square().sum() / singular_values.square().sum())
    once, four = LowRankCodec(rank=2, bits=8), LowRankCodec(rank=2, bits=8, iterations=4)
    a, b = once.encode(matrix, "w"), four.encode(matrix, "w")
    assert a.energy_kept < 0.8 * best and 0.97 * best < b.energy_kept <= best + 1e-6
    assert a.size_bytes == b.size_bytes
    assert _relative_error(LowRankCodec().decode(b.description, b.payload), matrix) \
        < _relative_error(once.decode(a.description, a.payload), matrix)
    assert get_codec("lowrank", **four.params()).iterations == 4
    with pytest.raises(CodecError):
        LowRankCodec(iterations=0)


def test_the_manifest_sets_the_low_rank_encoders_power_iterations() -> None:
    from node.config.manifest import ProtocolSection
    from node.rounds.dilocox.round import codec_for

    assert codec_for(ProtocolSection(power_iterations=3)).iterations == 3
    assert codec_for(ProtocolSection()).iterations == ProtocolSection().power_iterations


def test_lowrank_track_turns_the_warm_start_as_an_encode_does_and_sends_nothing() -> None:
    """A committee member's rounds sat out (`Codec.track`): the next encode starts where it
    would had those rounds been sent, and keeps more than from its last send's subspace."""
    generator = torch.Generator().manual_seed(5)
    left = torch.linalg.qr(torch.randn(200, 6, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(150, 6, generator=generator)).Q
    matrix = left @ torch.diag(torch.tensor([10.0, 9.0, 8.0, 2.0, 1.0, 0.5])) @ right.T
    sending, tracking, idle = (LowRankCodec(rank=2, bits=8) for _ in range(3))
    for codec in (sending, tracking, idle):
        codec.encode(matrix, "w")
    for _ in range(5):
        sending.encode(matrix, "w")
        tracking.track(matrix, "w")
    assert torch.equal(sending.state_dict()["warm_start"]["w"], tracking.state_dict()["warm_start"]["w"])
    assert tracking.encode(matrix, "w").payload == sending.encode(matrix, "w").payload
    assert tracking.encode(matrix, "w").energy_kept > idle.encode(matrix, "w").energy_kept + 0.01
    stateless = get_codec("blockwise", bits=8)
    stateless.track(matrix, "w")
    assert stateless.state_dict() == {}


def test_lowrank_is_accurate_on_an_exactly_low_rank_matrix() -> None:
    generator = torch.Generator().manual_seed(4)
    matrix = torch.randn(200, 4, generator=generator) @ torch.randn(4, 150, generator=generator)
    codec = LowRankCodec(rank=4, bits=8)
    encoded = codec.encode(matrix, "w")
    assert encoded.energy_kept > 0.9999
    assert _relative_error(codec.decode(encoded.description, encoded.payload), matrix) < 0.02


def test_lowrank_fallbacks_and_rank_changes() -> None:
    codec = LowRankCodec(rank=4, min_elements=100)
    assert codec.encode(torch.randn(500), "bias").description["codec"] == "blockwise"
    assert codec.encode(torch.randn(5, 5), "small").description["codec"] == "blockwise"
    assert codec.encode(torch.randn(4, 40), "thin").description["codec"] == "blockwise"  # no saving
    conv = codec.encode(torch.randn(32, 16, 3, 3), "conv")
    assert conv.description == {"codec": "lowrank", "shape": [32, 16, 3, 3], "rank": 4, "bits": 8}
    assert conv.energy_kept is not None and 0 <= conv.energy_kept <= 1
    matrix = torch.randn(64, 64)
    for rank in (2, 6, 3):
        codec.set_rank("m", rank)
        encoded = codec.encode(matrix, "m")
        assert encoded.description["rank"] == rank
        assert codec.decode(encoded.description, encoded.payload).shape == matrix.shape
    codec.bits = 4
    assert codec.encode(matrix, "m").description["bits"] == 4
    with pytest.raises(CodecError, match="bits"):
        codec.bits = 6
    with pytest.raises(CodecError, match="rank"):
        codec.set_rank("m", 0)


def test_lowrank_decodes_to_the_bits_of_a_fixed_order_sum_on_any_hardware() -> None:
    """φ is agreed bitwise, so a message must decode to the same bits on every node: P·Qᵀ summed
    term by term in rank order, each product and sum rounded once, as numpy's elementwise fp32
    arithmetic does anywhere. A matmul differs from it on this machine (MKL's default path;
    its reproducible mode MKL_CBWR=COMPATIBLE agrees), so this fails if decoding uses one."""
    import numpy as np
    from protocol.codecs.blockwise import dequantize_groups, unpack_codes
    from protocol.codecs.lowrank import outer_sum
    codec = LowRankCodec(rank=8, bits=8)
    rows, cols, rank = 100, 48, 8  # 100 rows: more than one block of outer_sum, and a partial one
    encoded = codec.encode(torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)), "w")
    payload = bytes(encoded.payload)
    scales = np.frombuffer(payload[:8 * rank], dtype="<f4")
    codes = unpack_codes(memoryview(payload[8 * rank:]), (rows + cols) * rank, 8, "lowrank").numpy()
    left = dequantize_groups(torch.from_numpy(scales[:rank].copy()),
                             torch.from_numpy(codes[:rows * rank].reshape(rank, rows)), 8).numpy()
    right = dequantize_groups(torch.from_numpy(scales[rank:].copy()),
                              torch.from_numpy(codes[rows * rank:].reshape(rank, cols)), 8).numpy()
    expected = left[0][:, None] * right[0]
    for k in range(1, rank):
        expected = expected + left[k][:, None] * right[k]
    decoded = codec.decode(encoded.description, encoded.payload)
    assert torch.equal(decoded, torch.from_numpy(expected))
    assert torch.equal(outer_sum(torch.from_numpy(left), torch.from_numpy(right)), decoded)


def test_lowrank_state_round_trip_reproduces_encoding() -> None:
    matrix = torch.randn(64, 32)
    first = LowRankCodec(rank=3)
    first.set_rank("w", 5)
    first.encode(matrix, "w")
    second = get_codec("lowrank", **first.params())
    second.load_state_dict(first.state_dict())
    assert second.rank_of("w") == 5
    assert first.encode(matrix, "w").payload == second.encode(matrix, "w").payload


def test_lowrank_zero_matrix_decodes_to_zero() -> None:
    codec = LowRankCodec(rank=2, min_elements=0)
    encoded = codec.encode(torch.zeros(20, 30), "z")
    assert encoded.energy_kept == 1.0
    assert torch.equal(codec.decode(encoded.description, encoded.payload), torch.zeros(20, 30))


def test_encode_refuses_bad_tensors() -> None:
    with pytest.raises(CodecError, match="NaN or infinite"):
        get_codec("blockwise").encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(CodecError, match="range of fp16"):
        get_codec("fp16").encode(torch.tensor([1e6]))
    with pytest.raises(CodecError, match="floating-point"):
        get_codec("identity").encode(torch.tensor([1, 2]))


def test_registry() -> None:
    assert codec_names() == ["bf16", "blockwise", "fp16", "identity", "lowrank", "topk"]
    for name, params in ALL_CODECS:
        codec = get_codec(name, **params)
        assert get_codec(name, **codec.params()).params() == codec.params()
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec("zstd")
    with pytest.raises(CodecError, match="does not take parameters"):
        get_codec("identity", bits=8)
    with pytest.raises(CodecError, match="block_size"):
        get_codec("blockwise", block_size=0)
    with pytest.raises(CodecError, match="bits"):
        get_codec("blockwise", bits=2)


def test_decode_checks_the_element_cap_before_allocating() -> None:
    encoded = get_codec("blockwise").encode(torch.randn(100))
    with pytest.raises(CodecError, match="exceeds the cap of 99 elements"):
        get_codec("blockwise").decode(encoded.description, encoded.payload, max_elements=99)
    huge = {"codec": "lowrank", "shape": [1 << 30, 1 << 30], "rank": 1, "bits": 8}
    with pytest.raises(CodecError, match="exceeds the cap"):
        decode(huge, b"")
    with pytest.raises(CodecError, match="max_elements"):
        decode(encoded.description, encoded.payload, max_elements=0)
    assert isinstance(Encoded({"codec": "identity", "shape": []}, b"\0\0\0\0").size_bytes, int)
