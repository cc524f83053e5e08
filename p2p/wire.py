"""The framed, signed message format on lowcomm streams. Pure: bytes in, bytes or errors out.

A stream carries, in each direction, a sequence of *frames* and then one *status*:

    frame  = b"F" | u32 header_len | header (msgpack) | Ed25519 signature (64) | payload
    status = b"S" | u16 reason | u16 detail_len | detail (UTF-8)

The header names the swarm, the manifest digest, the message kind and mode, the round, the
sender and recipient peer ids, a random nonce, the sender's clock, where this frame's payload
lies in the whole message (offset, length, frame index, frame size, frame and stream counts),
the payload's BLAKE3-256 digest, the tensor manifest (first frame of each stream) and a few
small application fields. The signature covers a domain tag and the exact header bytes, so
every field, including swarm, round and recipient, is bound to the sender's key.

A large message is cut into frames of `frame_size` bytes; frame j travels on stream
j % streams, and every stream carries as many frames as the others (trailing frames may be
empty). Each frame is independently signed and digested, so hashing, sending and checking
pipeline frame by frame, and a receiver never holds an unverified frame longer than one frame.

`check_head` runs every check that needs only the header, in the order that costs least to an
attacker's victim: size, signature against the stream's authenticated peer, decoding with
bounds, version, sender, swarm, manifest, recipient, clock, and then every size bound. The
round predicate and replay guard are the transport's (they need state).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import blake3
import msgpack
from hivemind.p2p import PeerID

from p2p.errors import Reason, Refusal
from p2p.identity import SIGNATURE_BYTES, verify_signature
from p2p.limits import WireLimits
from p2p.version import WIRE_VERSION, incompatibility

VERSION = WIRE_VERSION  # the header's "v" (p2p/version.py: what a change of it means)
TAG_FRAME = b"F"
TAG_STATUS = b"S"
FRAME_PREFIX = struct.Struct(">cI")      # tag, header length
STATUS_PREFIX = struct.Struct(">cHH")    # tag, reason, detail length
MAX_STATUS_DETAIL_BYTES = 512
NONCE_BYTES = 16
DIGEST_BYTES = 32
SIGNING_DOMAIN = b"lowcomm/stream-header/v1\x00"
MAX_ROUND = (1 << 62) - 1
MAX_ID_BYTES = 128        # peer ids are 38 bytes for Ed25519
MAX_LABEL_BYTES = 128     # swarm id, manifest digest, kind

# dtype name -> bytes per element. Only plain numeric types: nothing needs a Python object.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class Mode:
    """How a message travels: one-way push, the initiator's half of a swap, or the reply."""

    PUSH = 1
    SWAP = 2
    REPLY = 3
    ALL = (PUSH, SWAP, REPLY)
    NAMES = {PUSH: "push", SWAP: "swap", REPLY: "reply"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a message: its name, dtype, shape and byte length in the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.nbytes]


@dataclass(frozen=True)
class MessageHeader:
    """The decoded, checked header of one frame."""

    swarm: str
    manifest: str
    kind: str
    mode: int
    round: int
    sender: bytes
    recipient: bytes
    nonce: bytes
    reply_to: bytes | None
    timestamp: float
    total: int              # payload bytes of the whole message
    frame: int              # index of this frame
    frames: int             # frames in the message
    streams: int            # parallel streams the frames are spread over
    frame_size: int         # payload bytes per frame (the last one may be shorter)
    length: int             # payload bytes in this frame
    digest: bytes           # BLAKE3-256 of this frame's payload
    tensors: tuple[TensorEntry, ...] | None   # present on each stream's first frame
    meta: dict[str, Any]
    version: int = VERSION

    @property
    def offset(self) -> int:
        return self.frame * self.frame_size

    def message_key(self) -> tuple:
        """Fields every frame of one message must agree on."""
        return (self.swarm, self.manifest, self.kind, self.mode, self.round, self.sender, self.recipient,
                self.nonce, self.reply_to, self.total, self.frames, self.streams, self.frame_size)

    def to_wire(self) -> dict:
        return {
            "v": self.version, "swarm": self.swarm, "manifest": self.manifest, "kind": self.kind,
            "mode": self.mode, "round": self.round, "sender": self.sender, "recipient": self.recipient,
            "nonce": self.nonce, "reply_to": self.reply_to, "ts": self.timestamp, "total": self.total,
            "frame": self.frame, "frames": self.frames, "streams": self.streams,
            "frame_size": self.frame_size, "length": self.length, "digest": self.digest,
            "tensors": None if self.tensors is None else [t.to_wire() for t in self.tensors],
            "meta": self.meta,
        }


_FIELDS = frozenset(("v", "swarm", "manifest", "kind", "mode", "round", "sender", "recipient", "nonce",
                     "reply_to", "ts", "total", "frame", "frames", "streams", "frame_size", "length", "digest",
                     "tensors", "meta"))


def new_payload_hasher():
    """The payload digest, BLAKE3-256, defined here only: senders and receivers both use it.

    BLAKE3 rather than BLAKE2b: both ends hash every byte, and on the machines we measured
    BLAKE2b (~775 MB/s a core) cost signed streams a third of hivemind's raw stream speed,
    BLAKE3 (SIMD) none of it (benchmarks/NOTEBOOK.md, signed streams)."""
    return blake3.blake3()


def payload_digest(*chunks: bytes | memoryview) -> bytes:
    """The payload digest of the concatenated chunks."""
    hasher = new_payload_hasher()
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.digest()


def frame_count(total: int, frame_size: int) -> int:
    """Frames of a message: at least one, even for an empty payload."""
    return max(1, math.ceil(total / frame_size))


def frame_length(total: int, frame_size: int, frame: int) -> int:
    return max(0, min(frame_size, total - frame * frame_size))


# ---------------------------------------------------------------------------- encoding

def encode_header(header: MessageHeader) -> bytes:
    return msgpack.packb(header.to_wire(), use_bin_type=True)


def signing_input(header_bytes: bytes) -> bytes:
    return SIGNING_DOMAIN + header_bytes


def frame_prefix(header_bytes: bytes, signature: bytes) -> bytes:
    """Everything of a frame but its payload."""
    return FRAME_PREFIX.pack(TAG_FRAME, len(header_bytes)) + header_bytes + signature


def encode_status(reason: Reason, detail: str = "") -> bytes:
    text = detail.encode("utf-8", "replace")[:MAX_STATUS_DETAIL_BYTES]
    return STATUS_PREFIX.pack(TAG_STATUS, int(reason), len(text)) + text


def decode_status_body(code: int, detail: bytes) -> tuple[Reason, str]:
    return Reason.from_wire(code), detail.decode("utf-8", "replace")


# ---------------------------------------------------------------------------- decoding

def _fail(reason: Reason, detail: str) -> Refusal:
    return Refusal(reason, detail)


def _int(value: Any, name: str, low: int = 0, high: int = MAX_ROUND) -> int:
    # `type(...) is int` on purpose: msgpack never yields bool for ints, but a crafted header
    # could carry `true` where a count belongs, and bool is an int subclass in Python.
    if type(value) is not int or not low <= value <= high:
        raise _fail(Reason.MALFORMED, f"header field {name!r} must be an integer in [{low}, {high}]")
    return value


def _text(value: Any, name: str, limit: int = MAX_LABEL_BYTES) -> str:
    if type(value) is not str or not 0 < len(value.encode("utf-8", "surrogatepass")) <= limit:
        raise _fail(Reason.MALFORMED, f"header field {name!r} must be a non-empty string of at most {limit} bytes")
    return value


def _blob(value: Any, name: str, size: int | None = None, limit: int = MAX_ID_BYTES) -> bytes:
    if type(value) is not bytes or (size is not None and len(value) != size) or not 0 < len(value) <= limit:
        expected = f"{size} bytes" if size is not None else f"1 to {limit} bytes"
        raise _fail(Reason.MALFORMED, f"header field {name!r} must be {expected} of binary data")
    return value


def decode_header_bytes(raw: bytes, limits: WireLimits, sender: bytes | None = None) -> MessageHeader:
    """Decode and type-check a header; raise Refusal(MALFORMED/WRONG_VERSION/TOO_LARGE).

    The version is checked before the fields, so a header of another release, whatever its
    fields, is refused with the sentence that names both versions (`sender`: the stream's peer)."""
    if len(raw) > limits.max_header_bytes:
        raise _fail(Reason.TOO_LARGE, f"header of {len(raw)} bytes exceeds {limits.max_header_bytes}")
    try:
        # Explicit caps keep a crafted header from making the decoder build huge containers;
        # msgpack's own nesting limit stops deep recursion; ext types are refused outright.
        obj = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True,
                              max_str_len=limits.max_header_bytes, max_bin_len=limits.max_header_bytes,
                              max_array_len=max(limits.max_tensors, 64), max_map_len=64,
                              max_ext_len=0, timestamp=0)
    except Exception as error:  # msgpack raises many types (ExtraData, ValueError, ...); all mean MALFORMED
        if "exceeds max" in str(error):  # a container beyond our caps, e.g. too many tensors
            raise _fail(Reason.TOO_LARGE, "header holds a list or map larger than the bounds") from None
        raise _fail(Reason.MALFORMED, f"header is not valid msgpack ({type(error).__name__})") from None
    if type(obj) is not dict:
        raise _fail(Reason.MALFORMED, "header is not a msgpack map")
    if incompatibility("", obj.get("v")) is not None:
        peer = PeerID(sender).to_base58() if sender else "(unnamed)"
        raise _fail(Reason.WRONG_VERSION, incompatibility(peer, obj.get("v")))
    if obj.keys() != _FIELDS:
        missing, extra = sorted(_FIELDS - obj.keys()), sorted(map(str, obj.keys() - _FIELDS))[:5]
        raise _fail(Reason.MALFORMED, f"header fields differ: missing {missing}, unexpected {extra}")

    mode = _int(obj["mode"], "mode", 1, 3)
    total = _int(obj["total"], "total", 0, 1 << 62)
    if total > limits.max_message_bytes:
        raise _fail(Reason.TOO_LARGE, f"message of {total} bytes exceeds {limits.max_message_bytes}")
    frame_size = _int(obj["frame_size"], "frame_size", 1, 1 << 62)
    if not limits.min_frame_bytes <= frame_size <= limits.max_frame_bytes:
        raise _fail(Reason.TOO_LARGE, f"frame size {frame_size} is outside "
                                      f"[{limits.min_frame_bytes}, {limits.max_frame_bytes}]")
    streams = _int(obj["streams"], "streams", 1, 1 << 62)
    if streams > limits.max_streams_per_message:
        raise _fail(Reason.TOO_LARGE, f"{streams} streams exceed the bound of {limits.max_streams_per_message}")
    frames = _int(obj["frames"], "frames", 1, 1 << 62)
    if frames != max(streams, frame_count(total, frame_size)):
        raise _fail(Reason.MALFORMED, f"{frames} frames do not cover {total} bytes in frames of {frame_size} "
                                      f"over {streams} streams")
    frame = _int(obj["frame"], "frame", 0, frames - 1)
    length = _int(obj["length"], "length", 0, 1 << 62)
    if length != frame_length(total, frame_size, frame):
        raise _fail(Reason.MALFORMED, f"frame {frame} claims {length} bytes, its slot holds "
                                      f"{frame_length(total, frame_size, frame)}")
    reply_to = obj["reply_to"]
    if mode == Mode.REPLY:
        reply_to = _blob(reply_to, "reply_to", NONCE_BYTES)
    elif reply_to is not None:
        raise _fail(Reason.MALFORMED, "only a reply may carry 'reply_to'")
    timestamp = obj["ts"]
    if type(timestamp) is not float or not math.isfinite(timestamp):
        raise _fail(Reason.MALFORMED, "header field 'ts' must be a finite float")

    tensors = None if obj["tensors"] is None else decode_manifest(obj["tensors"], total, limits)
    return MessageHeader(
        swarm=_text(obj["swarm"], "swarm"), manifest=_text(obj["manifest"], "manifest"),
        kind=_text(obj["kind"], "kind"), mode=mode, round=_int(obj["round"], "round"),
        sender=_blob(obj["sender"], "sender"), recipient=_blob(obj["recipient"], "recipient"),
        nonce=_blob(obj["nonce"], "nonce", NONCE_BYTES), reply_to=reply_to, timestamp=timestamp,
        total=total, frame=frame, frames=frames, streams=streams, frame_size=frame_size, length=length,
        digest=_blob(obj["digest"], "digest", DIGEST_BYTES), tensors=tensors,
        meta=decode_meta(obj["meta"], limits))


def decode_manifest(entries: Any, total: int, limits: WireLimits) -> tuple[TensorEntry, ...]:
    """Check a tensor manifest against every bound; it must describe exactly `total` bytes."""
    if type(entries) is not list:
        raise _fail(Reason.MALFORMED, "tensor manifest must be a list")
    if len(entries) > limits.max_tensors:
        raise _fail(Reason.TOO_LARGE, f"{len(entries)} tensors exceed the bound of {limits.max_tensors}")
    result, names, described = [], set(), 0
    for index, entry in enumerate(entries):
        if type(entry) is not list or len(entry) != 4:
            raise _fail(Reason.MALFORMED, f"tensor entry {index} must be [name, dtype, shape, nbytes]")
        name, dtype, shape, nbytes = entry
        name = _text(name, f"tensors[{index}].name", limits.max_name_bytes)
        if name in names:
            raise _fail(Reason.MALFORMED, f"tensor name {name!r} appears twice")
        names.add(name)
        if type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise _fail(Reason.MALFORMED, f"tensor {name!r} has dtype {str(dtype)[:32]!r}, "
                                          f"not one of {sorted(DTYPE_SIZES)}")
        if type(shape) is not list or len(shape) > limits.max_ndim:
            raise _fail(Reason.MALFORMED, f"tensor {name!r} shape must be a list of at most "
                                          f"{limits.max_ndim} dimensions")
        elements = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise _fail(Reason.MALFORMED, f"tensor {name!r} has a dimension that is not a natural number")
            elements *= dim
            # Stop multiplying as soon as the bound is passed: a shape of eight 2**62 is cheap to refuse.
            if elements > limits.max_tensor_elements:
                raise _fail(Reason.TOO_LARGE, f"tensor {name!r} claims more than "
                                              f"{limits.max_tensor_elements} elements")
        if type(nbytes) is not int or nbytes != elements * DTYPE_SIZES[dtype]:
            raise _fail(Reason.MALFORMED, f"tensor {name!r} declares {nbytes!r} bytes, its shape and dtype "
                                          f"need {elements * DTYPE_SIZES[dtype]}")
        described += nbytes
        result.append(TensorEntry(name, dtype, tuple(shape), nbytes))
    if described != total:
        raise _fail(Reason.MALFORMED, f"tensor manifest describes {described} bytes, the payload has {total}")
    return tuple(result)


def decode_meta(meta: Any, limits: WireLimits) -> dict[str, Any]:
    """Small application fields: str keys, scalar or short str/bytes values."""
    if type(meta) is not dict or len(meta) > limits.max_meta_entries:
        raise _fail(Reason.MALFORMED, f"header field 'meta' must be a map of at most "
                                      f"{limits.max_meta_entries} entries")
    for key, value in meta.items():
        _text(key, "meta key", 64)
        if value is None or type(value) in (bool, int, float):
            continue
        if type(value) in (str, bytes) and len(value) <= limits.max_meta_value_bytes:
            continue
        raise _fail(Reason.MALFORMED, f"meta field {key!r} must be a scalar or a string of at most "
                                      f"{limits.max_meta_value_bytes} bytes")
    return meta


# ---------------------------------------------------------------------------- checking

@dataclass(frozen=True)
class Expectations:
    """What this node requires of every header it accepts."""

    swarm: str
    manifest: str
    local_peer: bytes
    limits: WireLimits = WireLimits()


def check_head(raw_header: bytes, signature: bytes, stream_peer: bytes, expect: Expectations,
               now: float) -> MessageHeader:
    """All stateless checks of one frame's header; raise Refusal with the first failing reason."""
    if len(raw_header) > expect.limits.max_header_bytes:
        raise _fail(Reason.TOO_LARGE, f"header of {len(raw_header)} bytes exceeds {expect.limits.max_header_bytes}")
    if len(signature) != SIGNATURE_BYTES or not verify_signature(stream_peer, signing_input(raw_header), signature):
        raise _fail(Reason.BAD_SIGNATURE, "header signature is not valid for the stream's peer")
    header = decode_header_bytes(raw_header, expect.limits, stream_peer)
    if header.sender != stream_peer:
        raise _fail(Reason.WRONG_SENDER, "header names a sender other than the stream's peer")
    if header.swarm != expect.swarm:
        raise _fail(Reason.WRONG_SWARM, f"message is for swarm {header.swarm!r}, this node is in {expect.swarm!r}")
    if header.manifest != expect.manifest:
        raise _fail(Reason.WRONG_MANIFEST, f"message uses manifest {header.manifest[:40]!r}, "
                                           f"this node uses {expect.manifest[:40]!r}")
    if header.recipient != expect.local_peer:
        raise _fail(Reason.WRONG_RECIPIENT, "message is addressed to another peer")
    if abs(now - header.timestamp) > expect.limits.max_clock_skew_s:
        raise _fail(Reason.EXPIRED, f"sender clock is {now - header.timestamp:+.0f} s off "
                                    f"(more than {expect.limits.max_clock_skew_s:.0f} s)")
    return header


def decode_frame(data: bytes, stream_peer: bytes, expect: Expectations, now: float) -> tuple[MessageHeader, memoryview]:
    """Parse one complete frame held in memory (tests and fuzzing; streams parse incrementally).

    Checks exactly what a stream receiver checks, including the payload digest.
    """
    view = memoryview(data)
    if len(view) < FRAME_PREFIX.size:
        raise _fail(Reason.TRUNCATED, "frame is shorter than its prefix")
    tag, header_len = FRAME_PREFIX.unpack_from(view)
    if tag != TAG_FRAME:
        raise _fail(Reason.MALFORMED, f"expected a frame, got tag {tag!r}")
    if header_len > expect.limits.max_header_bytes:
        raise _fail(Reason.TOO_LARGE, f"header of {header_len} bytes exceeds {expect.limits.max_header_bytes}")
    start = FRAME_PREFIX.size
    if len(view) < start + header_len + SIGNATURE_BYTES:
        raise _fail(Reason.TRUNCATED, "frame ends inside its header or signature")
    raw_header = bytes(view[start:start + header_len])
    signature = bytes(view[start + header_len:start + header_len + SIGNATURE_BYTES])
    header = check_head(raw_header, signature, stream_peer, expect, now)
    body = view[start + header_len + SIGNATURE_BYTES:]
    if len(body) < header.length:
        raise _fail(Reason.TRUNCATED, f"frame carries {len(body)} of {header.length} payload bytes")
    if len(body) > header.length:
        raise _fail(Reason.MALFORMED, "bytes follow the frame's payload")
    if payload_digest(body) != header.digest:
        raise _fail(Reason.BAD_DIGEST, "payload does not match its signed digest")
    return header, body
