"""Decoding hostile input: any description, any bytes -> a bounded tensor or CodecError.

Property tests (hypothesis) feed every codec arbitrary descriptions (wrong types included),
arbitrary payloads, and mutations of valid encodings. Allocation is bounded two ways: the
decoded tensor never exceeds `max_elements`, and torch's profiler shows no single allocation
larger than what the payload and the cap allow.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from protocol.codecs import CodecError, decode, get_codec

CODECS = [get_codec("identity"), get_codec("fp16"), get_codec("bf16"),
          get_codec("blockwise", bits=8), get_codec("blockwise", bits=4, block_size=16),
          get_codec("lowrank", rank=3, bits=8, min_elements=0),
          get_codec("lowrank", rank=2, bits=4, min_elements=0),
          get_codec("topk", k=3, chunk=8, bits=2), get_codec("topk", k=64, chunk=4096, bits=8)]
MAX_ELEMENTS = 4096
FIELDS = ["codec", "shape", "bits", "block", "rank", "chunk", "k"]
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from(["identity", "fp16", "bf16", "blockwise", "lowrank", "topk"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
shapes = st.lists(st.integers(-3, 70), max_size=4) | st.lists(st.integers(-2**64, 2**64), max_size=3)
descriptions = st.one_of(
    plain_values,
    st.fixed_dictionaries({"codec": st.sampled_from(["identity", "fp16", "bf16", "blockwise", "lowrank",
                                                      "topk"]),
                           "shape": shapes | plain_values},
                          optional={"bits": st.sampled_from([4, 8, 0, 16, True]) | plain_values,
                                    "block": st.integers(-5, 300) | plain_values,
                                    "rank": st.integers(-2, 80) | plain_values,
                                    "chunk": st.integers(-2, 70) | plain_values,
                                    "k": st.integers(-2, 70) | plain_values,
                                    "extra": plain_values}))
payloads = st.binary(max_size=600) | st.sampled_from([None, "text", 3, bytearray(b"\x01" * 40),
                                                      memoryview(b"\x00" * 64),
                                                      memoryview(b"\x00" * 64)[::2]])


def _count(outcome: str) -> None:
    """Shown by --hypothesis-show-statistics: both outcomes must be exercised."""
    if currently_in_test_context():
        event(outcome)


def _decode_or_codec_error(codec: Any, description: Any, payload: Any) -> torch.Tensor | None:
    """Decode; any exception other than CodecError fails the test."""
    try:
        tensor = decode(description, payload, MAX_ELEMENTS) if codec is None else \
            codec.decode(description, payload, max_elements=MAX_ELEMENTS)
    except CodecError as error:
        message = str(error)
        assert message.endswith(".") and "\n" not in message and len(message) < 400
        _count("refused")
        return None
    _count("decoded")
    assert tensor.dtype == torch.float32 and tensor.numel() <= MAX_ELEMENTS
    assert bool(torch.isfinite(tensor).all())
    return tensor


@FUZZ
@given(codec_index=st.integers(-1, len(CODECS) - 1), description=descriptions, payload=payloads)
def test_arbitrary_descriptions_and_bytes(codec_index: int, description: Any, payload: Any) -> None:
    codec = None if codec_index < 0 else CODECS[codec_index]
    _decode_or_codec_error(codec, description, payload)


def _valid_encodings() -> list[tuple[Any, dict, bytes]]:
    generator = torch.Generator().manual_seed(0)
    encodings = []
    for codec in CODECS:
        for shape in [(5,), (6, 7), (3, 2, 4), ()]:
            encoded = codec.encode(torch.randn(shape, generator=generator), name=str(shape))
            encodings.append((codec, encoded.description, encoded.payload))
    return encodings


VALID = _valid_encodings()


@FUZZ
@given(index=st.integers(0, len(VALID) - 1),
       field=st.sampled_from(FIELDS + ["-delete", "+add", "none", "none"]),
       value=plain_values | shapes | st.integers(-1, 2**40), payload_edit=st.integers(0, 3),
       position=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_mutated_valid_encodings(index: int, field: str, value: Any, payload_edit: int,
                                 position: int, byte: int) -> None:
    codec, description, payload = VALID[index]
    description = dict(description)
    if field == "-delete":
        description.pop("shape", None)
    elif field == "+add":
        description["unexpected"] = value
    elif field in FIELDS:
        description[field] = value
    mutable = bytearray(payload)
    if payload_edit == 1 and mutable:
        mutable[position % len(mutable)] = byte                # flip one byte (scales included)
    elif payload_edit == 2:
        mutable = mutable[:position % (len(mutable) + 1)]      # truncate
    elif payload_edit == 3:
        mutable += bytes([byte]) * (1 + position % 9)          # extend
    _decode_or_codec_error(codec, description, bytes(mutable))
    _decode_or_codec_error(None, description, bytes(mutable))


@pytest.mark.parametrize("description, payload", [
    ({"codec": "identity", "shape": [2**40]}, b""),
    ({"codec": "lowrank", "shape": [2**20, 2**20], "rank": 1, "bits": 4}, b"\0" * 8 + b"\x88" * 2**20),
    ({"codec": "blockwise", "shape": [MAX_ELEMENTS], "bits": 8, "block": 2**20}, b"\0" * 4),
    ({"codec": "lowrank", "shape": [64, 64], "rank": 64, "bits": 8}, b"\0" * (512 + 8192)),
    ({"codec": "topk", "shape": [2**40], "chunk": 4096, "k": 64, "bits": 2}, b""),
    ({"codec": "topk", "shape": [MAX_ELEMENTS], "chunk": 1, "k": 1, "bits": 8},
     b"\0" * (8 * MAX_ELEMENTS + MAX_ELEMENTS // 8 + MAX_ELEMENTS)),
    ({"codec": "blockwise", "shape": [MAX_ELEMENTS], "bits": 4, "block": 1},
     b"\0" * (4 * MAX_ELEMENTS) + b"\x88" * (MAX_ELEMENTS // 2)),
])
def test_allocations_stay_within_the_payload_and_the_cap(description: dict, payload: bytes) -> None:
    """No allocation, Python or torch, beyond a small multiple of the payload and the cap."""
    bound = 8 * (MAX_ELEMENTS + len(payload)) + 65536
    tracemalloc.start()  # Python-level allocations (bytes copies); torch's are not traced here
    _decode_or_codec_error(None, description, payload)
    _, python_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        _decode_or_codec_error(None, description, payload)
    torch_peak = max((event.cpu_memory_usage for event in profiler.events()), default=0)
    assert python_peak < bound and torch_peak < bound, (python_peak, torch_peak, bound)


def test_one_error_type_for_caller_mistakes_too() -> None:
    encoded = get_codec("blockwise").encode(torch.randn(10))
    for max_elements in (0, -1, 1.5, True, None, "10"):
        with pytest.raises(CodecError, match="max_elements"):
            decode(encoded.description, encoded.payload, max_elements)
