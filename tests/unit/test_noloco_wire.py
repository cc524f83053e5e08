"""Quantized NoLoCo snapshots (protocol.wire_dtype = "int8" / "int4"): error bound, exact
sizes, and strict, bounded decoding of hostile messages (node/rounds/wire_tensors.py,
node/rounds/noloco/payload.py)."""

from __future__ import annotations

import math
import time
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from node.rounds.contributions import ContributionRefused
from node.rounds.noloco import payload
from node.rounds.wire_tensors import QUANT_BLOCK, QUANTIZED_BITS, tensor_wire_bytes
from node.simulator.exchange import InMemoryMessage
from p2p.messages import OutgoingTensor
from p2p.wire import DTYPE_SIZES
from protocol.noloco import NoLoCoSnapshot

SHAPES = {"w": (5, 30), "b": (7,), "s": ()}  # 150 elements: two blocks of 64 and one of 22
LEVELS = {8: 127, 4: 7}
U = 2.0 ** -24  # fp32 unit roundoff
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def snapshot_of(shapes: dict, seed: int = 0) -> NoLoCoSnapshot:
    generator = torch.Generator().manual_seed(seed)
    phi = {n: torch.randn(shape, generator=generator) for n, shape in shapes.items()}
    if "w" in phi:
        phi["w"][0, 0] = 40.0  # an outlier coarsens its own block only
    return NoLoCoSnapshot(phi, {n: 0.01 * torch.randn(t.shape, generator=generator)
                                for n, t in phi.items()})


def block_scales(tensor: torch.Tensor) -> torch.Tensor:
    """Per element, s = max|x| of its block of 64 (the flattened tensor cut in order)."""
    flat = tensor.reshape(-1)
    blocks = -(-flat.numel() // QUANT_BLOCK)
    padded = torch.nn.functional.pad(flat.abs(), (0, blocks * QUANT_BLOCK - flat.numel()))
    per_block = padded.reshape(blocks, QUANT_BLOCK).amax(dim=1)
    return per_block.repeat_interleave(QUANT_BLOCK)[:flat.numel()].reshape(tensor.shape)


def sent_groups(snapshot: NoLoCoSnapshot, layout: str) -> dict:
    if layout == "theta":
        return {"theta": snapshot.fast_weights()}
    return {"phi": snapshot.slow_weights, "delta": snapshot.local_progress}


def decode(tensors: list, layout: str = "theta", dtype: str = "int8", shapes: dict = SHAPES):
    return payload.decode_snapshot(InMemoryMessage(0, tensors), layout, "peer-7", dtype, shapes)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("layout", ["theta", "phi_delta"])
def test_round_trip_is_within_half_a_step_of_each_blocks_scale(dtype, layout):
    """q = round(x/s·L) with |x/s·L − q| ≤ 1/2, so |x − q·s/L| ≤ s/(2L). In fp32, x/s·L carries
    a relative error of at most 2u (two roundings), which can tip q across a half only within
    2u·L of it: +2u·s; decoding q·(s/L) rounds twice more: +2u·s. Bound: s/(2L) + 4u·s."""
    levels = LEVELS[QUANTIZED_BITS[dtype]]
    snapshot = snapshot_of(SHAPES)
    groups = decode(payload.encode_snapshot(snapshot, dtype, layout), layout, dtype)
    for group, values in sent_groups(snapshot, layout).items():
        assert set(groups[group]) == set(SHAPES)
        for name, original in values.items():
            decoded, s = groups[group][name], block_scales(original)
            assert decoded.shape == original.shape and decoded.dtype == torch.float32
            assert ((decoded - original).abs() <= s / (2 * levels) + 4 * U * s).all()
    zeros = NoLoCoSnapshot({"z": torch.zeros(70)}, {"z": torch.zeros(70)})
    assert torch.equal(decode(payload.encode_snapshot(zeros, dtype, "theta"), "theta", dtype,
                              {"z": (70,)})["theta"]["z"], torch.zeros(70))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased_within_one_step_and_reproducible(dtype):
    """protocol.wire_rounding = "stochastic": q = ⌊x/s·L + u⌋, so |x − q·s/L| < s/L (+ fp32, as
    above) and E[q·s/L] = x, where rounding to nearest sends a value that sits between two codes
    to the same one every time (its bias does not average out over rounds: issue 19). The same
    wire format, decoded by the same code; one seed, the same bytes."""
    levels = LEVELS[QUANTIZED_BITS[dtype]]
    snapshot = snapshot_of(SHAPES)
    theta = snapshot.fast_weights()

    def sent(seed: int | None) -> list:
        rounding = None if seed is None else torch.Generator().manual_seed(seed)
        return payload.encode_snapshot(snapshot, dtype, "theta", rounding)

    assert [t.data.tobytes() for t in sent(3)] == [t.data.tobytes() for t in sent(3)]
    assert [t.data.tobytes() for t in sent(3)] != [t.data.tobytes() for t in sent(4)]
    draws = 400
    total = {n: torch.zeros(shape) for n, shape in SHAPES.items()}
    for seed in range(draws):
        for name, decoded in decode(sent(seed), "theta", dtype)["theta"].items():
            s = block_scales(theta[name])
            assert ((decoded - theta[name]).abs() <= s / levels + 4 * U * s).all()
            total[name] += decoded
    nearest = decode(sent(None), "theta", dtype)["theta"]
    for name, original in theta.items():
        step = block_scales(original) / levels
        # the mean of 400 draws: each off by less than one step, so its spread is under
        # step / (2·√400) = step / 40; 4 such spreads is a bound no honest run crosses
        mean_error = (total[name] / draws - original).abs()
        assert (mean_error <= step / 10 + 8 * U * block_scales(original)).all(), name
        if name == "w":  # to nearest, the same error every time: many are above that bound
            assert ((nearest[name] - original).abs() > step / 10).sum() > 50


@pytest.mark.parametrize("count", [0, 1, 2, 63, 64, 65, 127, 128, 129, 1000])
def test_byte_sizes_are_exact(count):
    tensor = {"t": torch.randn(count)}
    for dtype, codes in (("int8", count), ("int4", (count + 1) // 2)):
        expected = 4 * math.ceil(count / QUANT_BLOCK) + codes
        [sent] = payload.encode_snapshot(NoLoCoSnapshot(tensor, tensor), dtype, "theta")
        assert sent.dtype == "uint8" and sent.shape == (expected,) and sent.data.nbytes == expected
        assert tensor_wire_bytes(count, dtype) == expected
    for layout in ("theta", "phi_delta"):
        for dtype in ("bf16", "fp32", "int8", "int4"):
            message = InMemoryMessage(0, payload.encode_snapshot(snapshot_of(SHAPES), dtype, layout))
            assert message.size_bytes == payload.snapshot_bytes(SHAPES, dtype, layout)
    # per parameter at scale: 1 + 4/64 (int8) and 1/2 + 4/64 (int4), against bf16's 2
    big = {"w": (4096, 64)}
    assert payload.snapshot_bytes(big, "int8", "theta") / 4096 / 64 == 1.0625
    assert payload.snapshot_bytes(big, "int4", "theta") / 4096 / 64 == 0.5625
    assert payload.snapshot_bytes(big, "int8", "phi_delta") == 2 * 4096 * 64 * 1.0625


def _edit(tensors: list, case: str, bits: int) -> list:
    """A valid quantized θ of SHAPES, broken one way; tensor "theta/w" is the one broken."""
    out = []
    for t in tensors:
        data = bytearray(memoryview(t.data).cast("B"))
        if t.name == "theta/w":
            if case == "missing":
                continue
            if case == "short":
                data = data[:-1]
            elif case == "long":
                data += b"\x01"
            elif case in ("nan_scale", "inf_scale", "negative_scale"):
                value = {"nan_scale": math.nan, "inf_scale": math.inf, "negative_scale": -1.0}[case]
                data[4:8] = np.float32(value).tobytes()  # the second block's scale
            elif case == "unused_code":
                data[-1] = 0x80  # −128 at 8 bits; a low nibble of 0 is −8 at 4 bits
            dtype = "int8" if case == "dtype" else "uint8"
            out.append(OutgoingTensor(t.name, dtype, (len(data),), np.frombuffer(bytes(data), np.uint8)))
        else:
            out.append(t)
    if case == "extra":
        out.append(OutgoingTensor("theta/extra", "uint8", (5,), np.zeros(5, np.uint8)))
    return out


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("case, clause", [
    ("short", "tensor theta/w arrived as uint8 (161,) (161 bytes), but protocol.wire_dtype"),
    ("long", "tensor theta/w arrived as uint8 (163,) (163 bytes)"),
    ("dtype", "tensor theta/w arrived as int8"),
    ("missing", "its tensors differ from ours: missing theta/w, unexpected none"),
    ("extra", "its tensors differ from ours: missing none, unexpected theta/extra"),
    ("nan_scale", "tensor theta/w: blockwise payload holds a negative or non-finite scale"),
    ("inf_scale", "tensor theta/w: blockwise payload holds a negative or non-finite scale"),
    ("negative_scale", "tensor theta/w: blockwise payload holds a negative or non-finite scale"),
    ("unused_code", "tensor theta/w: blockwise payload holds the unused"),
])
def test_every_malformation_is_refused_in_one_sentence_naming_sender_and_tensor(dtype, case, clause):
    bits = QUANTIZED_BITS[dtype]
    valid = payload.encode_snapshot(snapshot_of(SHAPES), dtype, "theta")
    decode(valid, dtype=dtype)  # the unbroken message decodes
    with pytest.raises(ContributionRefused) as refused:
        decode(_edit(valid, case, bits), dtype=dtype)
    sentence = str(refused.value)
    if bits == 4:  # the clauses' lengths are 8 bits' 12 + 150 bytes ± 1; 4 bits: 12 + 75
        clause = clause.replace("(161,) (161", "(86,) (86").replace("(163,) (163", "(88,) (88")
    assert refused.value.reason == "malformed" and clause in sentence
    assert sentence.startswith("NoLoCo snapshot from peer-7 is malformed: ")
    assert sentence.endswith("; dropped") and ". " not in sentence and "\n" not in sentence


def test_a_snapshot_of_the_other_layout_is_refused_as_layout_first():
    tensors = payload.encode_snapshot(snapshot_of(SHAPES), "int8", "phi_delta")
    with pytest.raises(ContributionRefused, match="carries the groups") as refused:
        decode(tensors, "theta")
    assert refused.value.reason == "layout"


def test_a_diverged_sender_sends_nan_scales_of_the_right_length_and_is_refused():
    theta = {n: t.clone() for n, t in snapshot_of(SHAPES).fast_weights().items()}
    theta["w"][1, 2] = math.nan
    tensors = payload.encode_snapshot(NoLoCoSnapshot(theta, {n: 0 * t for n, t in theta.items()}),
                                      "int4", "theta")
    assert InMemoryMessage(0, tensors).size_bytes == payload.snapshot_bytes(SHAPES, "int4", "theta")
    with pytest.raises(ContributionRefused, match="theta/w: blockwise payload holds a negative"):
        decode(tensors, dtype="int4")


# ---------------------------------------------------------------------------- hostile bytes
NAMES = ["theta/w", "theta/b", "theta/s", "theta/extra", "theta", "phi/w", "delta/b", "", "w"]
raw_tensors = st.lists(st.tuples(st.sampled_from(NAMES) | st.text(max_size=12),
                                 st.sampled_from(sorted(DTYPE_SIZES)), st.binary(max_size=300)),
                       max_size=5, unique_by=lambda t: t[0])


def _message(raw: list) -> InMemoryMessage:
    tensors = []
    for name, dtype, data in raw:
        count = len(data) // DTYPE_SIZES[dtype]
        body = np.frombuffer(data[:count * DTYPE_SIZES[dtype]], np.uint8)
        tensors.append(OutgoingTensor(name, dtype, (count,), body))
    return InMemoryMessage(0, tensors)


def _decode_or_refuse(message, layout: str, dtype: str) -> None:
    """Decodes to SHAPES' finite fp32 tensors, or raises ContributionRefused: nothing else."""
    try:
        groups = payload.decode_snapshot(message, layout, "peer-7", dtype, SHAPES)
    except ContributionRefused as refused:
        assert refused.reason in ("layout", "malformed")
        assert "peer-7" in str(refused) and "\n" not in str(refused) and len(str(refused)) < 400
        return
    for values in groups.values():
        assert {n: tuple(t.shape) for n, t in values.items()} == SHAPES
        assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in values.values())


@FUZZ
@given(raw=raw_tensors, layout=st.sampled_from(["theta", "phi_delta"]),
       dtype=st.sampled_from(["int8", "int4"]))
def test_arbitrary_tensors_are_decoded_or_refused(raw, layout, dtype):
    _decode_or_refuse(_message(raw), layout, dtype)


@FUZZ
@given(dtype=st.sampled_from(["int8", "int4"]), layout=st.sampled_from(["theta", "phi_delta"]),
       which=st.integers(0, 5), edit=st.integers(0, 3), position=st.integers(0, 10_000),
       byte=st.integers(0, 255))
def test_mutated_valid_snapshots_are_decoded_or_refused(dtype, layout, which, edit, position, byte):
    tensors = payload.encode_snapshot(snapshot_of(SHAPES), dtype, layout)
    target = tensors[which % len(tensors)]
    data = bytearray(memoryview(target.data).cast("B"))
    if edit == 0 and data:
        data[position % len(data)] = byte                       # flip one byte, scales included
    elif edit == 1:
        data = data[:position % (len(data) + 1)]                # truncate
    elif edit == 2:
        data += bytes([byte]) * (1 + position % 9)              # extend
    broken = OutgoingTensor(target.name if edit < 3 else target.name + "x", "uint8",
                            (len(data),), np.frombuffer(bytes(data), np.uint8))
    _decode_or_refuse(InMemoryMessage(0, [broken if t is target else t for t in tensors]),
                      layout, dtype)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("hostile", ["huge", "valid"])
def test_decoding_allocates_nothing_beyond_the_expected_size(dtype, hostile):
    """No single allocation, Python or torch, beyond a small multiple of what SHAPES imply,
    even for a message of 4 MB whose tensor is far longer than expected (refused unread)."""
    expected_elements = sum(math.prod(s) for s in SHAPES.values())
    bound = 8 * (expected_elements + payload.snapshot_bytes(SHAPES, dtype, "theta")) + 65536
    tensors = payload.encode_snapshot(snapshot_of(SHAPES), dtype, "theta")
    if hostile == "huge":
        tensors[0] = OutgoingTensor(tensors[0].name, "uint8", (1 << 22,), np.ones(1 << 22, np.uint8))
    message = InMemoryMessage(0, tensors)
    tracemalloc.start()
    try:
        _decode_or_refuse(message, "theta", dtype)
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        _decode_or_refuse(message, "theta", dtype)
    torch_peak = max((event.cpu_memory_usage for event in profiler.events()), default=0)
    assert python_peak < bound and torch_peak < bound, (python_peak, torch_peak, bound)


@pytest.mark.parametrize("dtype, ratio", [("bf16", 2.0), ("int8", 4 / 1.0625), ("int4", 4 / 0.5625)])
def test_the_status_views_compression_ratio_follows_the_bytes_received(dtype, ratio):
    from node.events import Swapped
    from node.ops.status import NodeStatus
    from node.ops.status_feed import StatusFeed
    shapes = {"w": (4096, 64)}
    feed = StatusFeed(NodeStatus(), param_bytes=4 * 4096 * 64, snapshot_sets=payload.tensor_sets(
        "theta"), traffic=lambda: (0, 0), peers_known=lambda: 0)
    feed._payload(Swapped(round=0, partner="p", partner_round=0,
                          bytes=payload.snapshot_bytes(shapes, dtype, "theta")))
    assert feed.status.compression_ratio == pytest.approx(ratio)


def test_rounds_per_minute_counts_rounds_ended_when_the_round_index_moves_back():
    """A node that ran ahead of its swarm goes back to its round (protocol/matching.py
    catch_up_round): the rate counts the rounds it ended, not the distance its index moved."""
    from node.events import RoundEnded
    from node.ops.status import NodeStatus
    from node.ops.status_feed import StatusFeed
    from node.rounds.noloco.round import NoLoCoOutcome
    feed = StatusFeed(NodeStatus(), param_bytes=4, snapshot_sets=1, traffic=lambda: (0, 0),
                      peers_known=lambda: 0)
    outcome = NoLoCoOutcome("d", [], 0.0, None, None, True, 1, 0, None, None)
    feed._started = time.monotonic() - 60.0  # started a minute ago
    for round_index in (40, 41, 42, 43, 1):  # round 43 ended with a move back to round 1
        feed._round(RoundEnded(round=round_index, step=0, round_seconds=1.0, outer_seconds=0.0,
                               outcome=outcome, peers_alive=2))
    assert feed.status.rounds_per_minute == pytest.approx(5.0, rel=0.05)
