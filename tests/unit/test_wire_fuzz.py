"""Fuzzing the frame decoder: random and mutated frames raise Refusal, never anything else.

Most random bytes die at the signature check, so the header decoder is also fuzzed behind a
valid signature (a malicious but authenticated peer), with random msgpack structures and with
valid headers whose fields are replaced by random values.
"""

import time

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.errors import Refusal
from p2p.identity import NodeIdentity
from p2p.limits import WireLimits
from p2p.wire import Expectations, decode_frame
from tests.p2p_helpers import MANIFEST, SWARM, make_frame, make_header, sign_frame

SENDER, RECEIVER = NodeIdentity.generate(), NodeIdentity.generate()
LIMITS = WireLimits(max_header_bytes=16 * 1024, max_tensors=64)
EXPECT = Expectations(SWARM, MANIFEST, RECEIVER.peer_id.to_bytes(), LIMITS)
PAYLOAD = b"payload-" * 16
VALID = make_frame(SENDER, RECEIVER.peer_id.to_bytes(), PAYLOAD)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=40) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=10), children, max_size=6),
    max_leaves=30)


def decode_or_refuse(frame: bytes):
    """The only acceptable outcomes: a decoded frame or a Refusal."""
    try:
        return decode_frame(frame, SENDER.peer_id.to_bytes(), EXPECT, time.time())
    except Refusal:
        return None


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_are_refused(data):
    assert decode_or_refuse(data) is None or data == VALID


@FUZZ
@given(st.binary(max_size=2048))
def test_random_header_bytes_behind_a_valid_signature_are_refused(raw):
    decode_or_refuse(sign_frame(SENDER, raw, PAYLOAD))


@FUZZ
@given(msgpack_values)
def test_random_msgpack_headers_behind_a_valid_signature_are_refused(obj):
    decode_or_refuse(sign_frame(SENDER, msgpack.packb(obj, use_bin_type=True), PAYLOAD))


FIELDS = sorted(make_header(SENDER, b"x").to_wire())


@FUZZ
@given(st.sampled_from(FIELDS), msgpack_values)
def test_valid_header_with_one_field_replaced_is_refused_or_consistent(field, value):
    wire = make_header(SENDER, RECEIVER.peer_id.to_bytes(), PAYLOAD).to_wire()
    wire[field] = value
    result = decode_or_refuse(sign_frame(SENDER, msgpack.packb(wire, use_bin_type=True), PAYLOAD))
    if result is not None:
        header, body = result
        assert header.length == len(body)
        # Later frames of a stream may omit the manifest; when present it describes the payload.
        assert header.tensors is None or header.total == sum(t.nbytes for t in header.tensors)


@FUZZ
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(VALID) - 1), st.integers(0, 255)),
                min_size=1, max_size=8),
       st.sampled_from(["flip", "truncate", "insert"]))
def test_mutated_valid_frames_are_refused_unless_unchanged(edits, how):
    frame = bytearray(VALID)
    for position, byte in edits:
        position = min(position, len(frame) - 1)
        if how == "flip":
            frame[position] = byte
        elif how == "truncate":
            del frame[position:]
            break
        else:
            frame.insert(position, byte)
    result = decode_or_refuse(bytes(frame))
    if result is not None:
        assert bytes(frame) == VALID and bytes(result[1]) == PAYLOAD
