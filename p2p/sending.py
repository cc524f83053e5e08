"""How one outgoing message is cut into signed frames over parallel streams, and sent.

`SendPlan` fixes, once per message, everything the frame headers share (nonce, frame size,
frame and stream counts, manifest); `send_stream_frames` writes the frames of one stream,
hashing the next frame in a worker thread while the current one is on the wire.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from concurrent.futures import Executor

from p2p import wire
from p2p.errors import LimitsError
from p2p.framing import StreamIO
from p2p.identity import NodeIdentity
from p2p.limits import TransferLimits, WireLimits
from p2p.messages import OutgoingMessage, slice_segments
from p2p.wire import (NONCE_BYTES, MessageHeader, Mode, encode_header, frame_count, frame_length, frame_prefix,
                      signing_input)

INLINE_HASH_BYTES = 256 * 1024   # below this, a thread hop costs more than hashing in place


def choose_frame_size(total: int, streams: int, frame_bytes: int, wire: WireLimits) -> int:
    """Frames of at most `frame_bytes`, the same number on every stream, so that all streams
    finish together (a stream left alone at the end runs at one window per round trip)."""
    if not total:
        return wire.min_frame_bytes
    frames_per_stream = math.ceil(total / (streams * frame_bytes))
    size = math.ceil(total / (streams * frames_per_stream))
    return max(wire.min_frame_bytes, min(size, wire.max_frame_bytes))


def choose_streams(total: int, limits: TransferLimits, wire: WireLimits) -> int:
    """One stream per `frame_bytes` of payload, up to `parallel_streams`."""
    wanted = max(1, math.ceil(total / limits.frame_bytes))
    return max(1, min(limits.parallel_streams, wire.max_streams_per_message, wanted))


class SendPlan:
    """The frames of one outgoing message."""

    def __init__(self, identity: NodeIdentity, *, swarm: str, manifest: str, recipient: bytes,
                 message: OutgoingMessage, mode: int, streams: int, limits: TransferLimits, wire: WireLimits,
                 reply_to: bytes | None = None):
        if mode not in Mode.ALL:
            raise ValueError(f"unknown mode {mode!r}")
        self.identity, self.message, self.mode = identity, message, mode
        self.swarm, self.manifest_digest, self.recipient, self.reply_to = swarm, manifest, recipient, reply_to
        self.total = message.total_bytes
        if self.total > wire.max_message_bytes:
            raise LimitsError(f"the {message.kind!r} message of {self.total} bytes was not sent: it "
                              f"exceeds the {wire.max_message_bytes}-byte bound this swarm's peers accept.")
        self.streams = max(1, min(streams, wire.max_streams_per_message))
        self.frame_size = choose_frame_size(self.total, self.streams, limits.frame_bytes, wire)
        self.frames = max(self.streams, frame_count(self.total, self.frame_size))
        self.chunk_bytes = limits.chunk_bytes
        self.segments = message.segments()
        self.tensors = message.manifest()
        self.nonce = os.urandom(NONCE_BYTES)
        self.timestamp = time.time()

    @property
    def kind(self) -> str:
        return self.message.kind

    def frame_views(self, frame: int) -> list[memoryview]:
        start = frame * self.frame_size
        return list(slice_segments(self.segments, start, start + frame_length(self.total, self.frame_size, frame)))

    def header(self, frame: int, digest: bytes, with_manifest: bool) -> MessageHeader:
        return MessageHeader(
            swarm=self.swarm, manifest=self.manifest_digest, kind=self.message.kind, mode=self.mode,
            round=self.message.round, sender=self.identity.peer_id.to_bytes(), recipient=self.recipient,
            nonce=self.nonce, reply_to=self.reply_to, timestamp=self.timestamp, total=self.total, frame=frame,
            frames=self.frames, streams=self.streams, frame_size=self.frame_size,
            length=frame_length(self.total, self.frame_size, frame), digest=digest,
            tensors=self.tensors if with_manifest else None, meta=dict(self.message.meta))

    def signed_prefix(self, frame: int, digest: bytes, with_manifest: bool) -> bytes:
        raw = encode_header(self.header(frame, digest, with_manifest))
        return frame_prefix(raw, self.identity.sign(signing_input(raw)))

    def stream_frames(self, stream: int) -> range:
        return range(stream, self.frames, self.streams)


def _digest_soon(plan: SendPlan, frame: int, executor: Executor | None) -> asyncio.Future:
    """The frame's digest: from the message's cache, computed in place if small, else in a thread."""
    loop = asyncio.get_running_loop()
    cache, key = plan.message.frame_digests, (plan.frame_size, frame)
    if key not in cache:
        views = plan.frame_views(frame)
        if sum(len(v) for v in views) >= INLINE_HASH_BYTES:
            future = loop.run_in_executor(executor, wire.payload_digest, *views)
            future.add_done_callback(lambda f: f.cancelled() or f.exception() or cache.setdefault(key, f.result()))
            return future
        cache[key] = wire.payload_digest(*views)
    future = loop.create_future()
    future.set_result(cache[key])
    return future


async def send_stream_frames(io: StreamIO, plan: SendPlan, stream: int, executor: Executor | None,
                             stop: asyncio.Event | None = None) -> None:
    """Write every frame that belongs to `stream`, each signed, hashing one frame ahead.

    Setting `stop` ends the stream's frames at the next frame boundary, where a status may follow.
    """
    frames = plan.stream_frames(stream)
    next_digest = _digest_soon(plan, frames[0], executor)
    for position, frame in enumerate(frames):
        digest = await next_digest
        if stop is not None and stop.is_set():
            return
        if position + 1 < len(frames):
            next_digest = _digest_soon(plan, frames[position + 1], executor)
        io.frame_open = True  # from here until the payload is out, a status would corrupt the stream
        await io.write(plan.signed_prefix(frame, digest, with_manifest=position == 0))
        await io.write_views(plan.frame_views(frame), plan.chunk_bytes)
        io.frame_open = False
        io.counters.frames_sent += 1
