"""The signed frame format: every check of wire.check_head/decode_frame, and the pure helpers."""

import time

import msgpack
import pytest

from p2p.errors import Reason, Refusal
from p2p.identity import NodeIdentity
from p2p.limits import InflightLedger, TransferLimits, WireLimits
from p2p.messages import OutgoingMessage, OutgoingTensor, slice_segments
from p2p.replay import ReplayGuard
from p2p.sending import choose_frame_size
from p2p.wire import (VERSION, FRAME_PREFIX, STATUS_PREFIX, TAG_STATUS, Expectations, TensorEntry, decode_frame,
                      decode_header_bytes, decode_status_body, encode_header, encode_status, frame_count)
from tests.p2p_helpers import MANIFEST, SWARM, make_frame, make_header, sign_frame

SENDER, RECEIVER, OTHER = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
EXPECT = Expectations(SWARM, MANIFEST, RECEIVER.peer_id.to_bytes(), WireLimits())
PAYLOAD = bytes(range(256)) * 8


def decode(frame: bytes, stream_peer: NodeIdentity = SENDER, expect: Expectations = EXPECT):
    return decode_frame(frame, stream_peer.peer_id.to_bytes(), expect, time.time())


def refusal_of(frame: bytes, **kwargs) -> Reason:
    with pytest.raises(Refusal) as error:
        decode(frame, **kwargs)
    return error.value.reason


def to_receiver(payload=PAYLOAD, **overrides) -> bytes:
    return make_frame(SENDER, RECEIVER.peer_id.to_bytes(), payload, **overrides)


def test_valid_frame_decodes_to_its_header_and_payload():
    header, body = decode(to_receiver(meta={"loss": 2.5, "step": 7}))
    assert bytes(body) == PAYLOAD
    assert header.swarm == SWARM and header.round == 1 and header.meta == {"loss": 2.5, "step": 7}
    assert header.tensors == (TensorEntry("t", "uint8", (len(PAYLOAD),), len(PAYLOAD)),)


@pytest.mark.parametrize("overrides, reason", [
    (dict(swarm="other-swarm"), Reason.WRONG_SWARM),
    (dict(manifest="ffff"), Reason.WRONG_MANIFEST),
    (dict(recipient=OTHER.peer_id.to_bytes()), Reason.WRONG_RECIPIENT),
    (dict(sender=OTHER.peer_id.to_bytes()), Reason.WRONG_SENDER),
    (dict(timestamp=time.time() - 3600.0), Reason.EXPIRED),
    (dict(version=VERSION + 1), Reason.WRONG_VERSION),
    (dict(mode=7), Reason.MALFORMED),
    (dict(round=-1), Reason.MALFORMED),
    (dict(round=True), Reason.MALFORMED),
    (dict(nonce=b"short"), Reason.MALFORMED),
    (dict(reply_to=b"x" * 16), Reason.MALFORMED),             # only replies answer something
    (dict(length=5), Reason.MALFORMED),                        # not this frame's slot
    (dict(frames=3), Reason.MALFORMED),
    (dict(streams=64, frames=64), Reason.TOO_LARGE),
    (dict(frame_size=10), Reason.TOO_LARGE),
    (dict(total=1 << 40, length=1 << 40), Reason.TOO_LARGE),
    (dict(meta={"k": b"x" * 5000}), Reason.MALFORMED),
    (dict(meta={"nested": [1, 2]}), Reason.MALFORMED),
])
def test_header_checks_refuse_with_their_reason(overrides, reason):
    assert refusal_of(to_receiver(**overrides)) == reason


@pytest.mark.parametrize("tensors, reason", [
    ((TensorEntry("t", "uint8", (10**6, 10**6), 10**12),), Reason.TOO_LARGE),      # 10^12 elements
    ((TensorEntry("t", "float32", (2**62,) * 8, 0),), Reason.TOO_LARGE),            # overflow bait
    ((TensorEntry("t", "object", (2048,), 2048),), Reason.MALFORMED),               # dtype whitelist
    ((TensorEntry("t", "uint8", (2047,), 2047),), Reason.MALFORMED),                # bytes != payload
    ((TensorEntry("t", "float32", (512,), 2048), TensorEntry("t", "uint8", (0,), 0)), Reason.MALFORMED),
    ((TensorEntry("t", "uint8", (-2048,), 2048),), Reason.MALFORMED),
    (tuple(TensorEntry(f"t{i}", "uint8", (0,), 0) for i in range(5000)), Reason.TOO_LARGE),
])
def test_tensor_manifest_bounds_are_checked_before_allocation(tensors, reason):
    assert refusal_of(to_receiver(tensors=tensors)) == reason


def test_signature_must_be_valid_and_made_by_the_streams_peer():
    frame = bytearray(to_receiver())
    frame[FRAME_PREFIX.size + 10] ^= 1                      # any header bit
    assert refusal_of(bytes(frame)) == Reason.BAD_SIGNATURE
    forged_by_other = make_frame(SENDER, RECEIVER.peer_id.to_bytes(), PAYLOAD, signer=OTHER)
    assert refusal_of(forged_by_other) == Reason.BAD_SIGNATURE
    # OTHER relaying SENDER's genuine frame: the stream is OTHER's, the signature SENDER's.
    assert refusal_of(to_receiver(), stream_peer=OTHER) == Reason.BAD_SIGNATURE


def test_payload_digest_truncation_and_trailing_bytes():
    frame = bytearray(to_receiver())
    frame[-1] ^= 0xFF
    assert refusal_of(bytes(frame)) == Reason.BAD_DIGEST
    assert refusal_of(to_receiver()[:-1]) == Reason.TRUNCATED
    assert refusal_of(to_receiver()[:20]) == Reason.TRUNCATED
    assert refusal_of(to_receiver() + b"x") == Reason.MALFORMED


def test_oversized_header_is_refused_by_its_declared_length():
    frame = FRAME_PREFIX.pack(b"F", 10**9) + b"\0" * 100
    assert refusal_of(frame) == Reason.TOO_LARGE


def test_signed_garbage_header_is_malformed_not_a_crash():
    for raw in (b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb({"v": VERSION}), b"\x92" * 2000,
                msgpack.packb({"v": VERSION, **{f"k{i}": i for i in range(100)}})):
        assert refusal_of(sign_frame(SENDER, raw)) in (Reason.MALFORMED, Reason.TOO_LARGE)


def test_header_roundtrip_is_exact():
    header = make_header(SENDER, RECEIVER.peer_id.to_bytes(), PAYLOAD, meta={"a": None, "b": "x"})
    assert decode_header_bytes(encode_header(header), WireLimits()) == header


def test_status_frames_roundtrip_and_unknown_codes_become_malformed():
    status = encode_status(Reason.STALE_ROUND, "round 3 is too old" * 100)
    tag, code, length = STATUS_PREFIX.unpack_from(status)
    assert tag == TAG_STATUS and length == 512
    assert decode_status_body(code, status[STATUS_PREFIX.size:])[0] == Reason.STALE_ROUND
    assert decode_status_body(999, b"")[0] == Reason.MALFORMED


def test_frames_cover_the_payload_evenly_over_streams():
    wire = WireLimits()
    assert frame_count(0, 65536) == 1
    for total in (100 * 10**6, 40 * 10**6, 20 * 10**6, 8 << 20, (8 << 20) * 4 + 1):
        size = choose_frame_size(total, 4, 8 << 20, wire)
        assert size <= 8 << 20 and frame_count(total, size) % 4 == 0, total  # every stream equally loaded
    assert choose_frame_size(40 * 10**6, 4, 8 << 20, wire) == 5 * 10**6
    assert choose_frame_size(1000, 4, 8 << 20, wire) == wire.min_frame_bytes


def test_segments_slice_without_copies():
    import numpy as np
    a, b = np.arange(10, dtype=np.uint8), np.arange(10, 20, dtype=np.uint8)
    message = OutgoingMessage.from_arrays("k", 0, {"a": a, "b": b})
    pieces = list(slice_segments(message.segments(), 5, 15))
    assert b"".join(bytes(p) for p in pieces) == bytes(range(5, 15)) and len(pieces) == 2
    with pytest.raises(ValueError, match="needs"):
        OutgoingTensor("x", "float32", (3,), b"12345678")


def test_replay_guard_remembers_frames_and_bounds_memory():
    guard = ReplayGuard(window_s=10.0, max_entries_per_peer=3)
    assert guard.check_and_remember(b"p", b"n1", 0, now=0.0) == "new"
    assert guard.check_and_remember(b"p", b"n1", 0, now=1.0) == "replayed"
    assert guard.check_and_remember(b"p", b"n1", 1, now=1.0) == "new"
    assert guard.check_and_remember(b"q", b"n1", 0, now=1.0) == "new"
    assert guard.check_and_remember(b"p", b"n2", 0, now=1.0) == "new"
    assert guard.check_and_remember(b"p", b"n3", 0, now=1.0) == "full"
    assert guard.check_and_remember(b"p", b"n3", 0, now=25.0) == "new"     # old entries expired
    assert len(guard) <= 4
    crowded = ReplayGuard(window_s=10.0, max_entries_per_peer=10, max_entries=3)
    assert [crowded.check_and_remember(bytes([i]), b"n", 0, now=0.0) for i in range(4)] == ["new"] * 3 + ["full"]
    assert crowded.check_and_remember(b"x", b"n", 0, now=21.0) == "new" and len(crowded) == 1


def test_inflight_ledger_refuses_instead_of_queueing():
    ledger = InflightLedger(TransferLimits(max_streams_per_peer=2, max_inflight_bytes_per_peer=100,
                                           max_inflight_bytes=150))
    assert ledger.try_open_stream(b"p") and ledger.try_open_stream(b"p") and not ledger.try_open_stream(b"p")
    ledger.close_stream(b"p")
    assert ledger.try_open_stream(b"p")
    assert ledger.try_reserve(b"p", 100) and not ledger.try_reserve(b"p", 1)
    assert ledger.try_reserve(b"q", 50) and not ledger.try_reserve(b"r", 1)
    ledger.release(b"p", 100)
    assert ledger.try_reserve(b"r", 1) and ledger.total_bytes == 51
