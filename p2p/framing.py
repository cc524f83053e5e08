"""Reading and writing frames and statuses on one hivemind binary stream.

`StreamIO` wraps the (reader, writer) pair that hivemind gives for a binary stream. Every read
and every drain has an idle timeout, every byte is counted, a header's declared length is
checked before a byte of it is read, and a frame's payload is read straight into a buffer the
caller allocated (after its bounds were checked) while a worker thread hashes what has arrived,
so hashing overlaps the network instead of following it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from contextlib import suppress
from concurrent.futures import Executor

from p2p import wire
from p2p.counters import TransportCounters
from p2p.errors import Reason, Refusal
from p2p.identity import SIGNATURE_BYTES
from p2p.wire import (FRAME_PREFIX, MAX_STATUS_DETAIL_BYTES, STATUS_PREFIX, TAG_FRAME, TAG_STATUS,
                      decode_status_body, encode_status)

READ_BYTES = 1 << 20          # largest single read request
HASH_BATCH_BYTES = 1 << 20    # hand the hashing thread at least this much at a time
READER_BUFFER_LIMIT = 1 << 20 # asyncio pauses the socket at 2x this; 64 KiB (the default) costs CPU
# A stream idle for its whole timeout while at least this much came on our other streams: our
# downlink was full, not the peer silent. Measured: a node on 512 kbit/s saw honest members'
# pushes idle 30 s behind a state download, struck them TIMEOUT and banned all three for 600 s
# (benchmarks/NOTEBOOK.md, "The same slow-link DiLoCoX run with relayed messages", run C).
CONGESTED_BYTES = 64 << 10


class PeerStatus(Exception):
    """The peer sent a status where we expected a frame (a refusal, or an early final status)."""

    def __init__(self, reason: Reason, detail: str):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason.name}: {detail}")


class StreamIO:
    """One binary stream with counted, time-bounded reads and writes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counters: TransportCounters,
                 idle_timeout_s: float, executor: Executor | None = None):
        self.reader, self.writer = reader, writer
        self.counters = counters
        self.idle_timeout_s = idle_timeout_s
        self.executor = executor
        self.frame_open = False  # True while a frame is half written: no status may be sent then
        self.relayed = False     # the stream goes through a circuit relay (p2p/paths.py)
        self.addr = None         # the address of the connection it runs on, where we opened it
        # The bindings create readers with asyncio's 64 KiB default; a larger limit means fewer
        # pause/resume cycles and larger reads on multi-megabyte payloads. Private attribute,
        # present on every asyncio/uvloop StreamReader; harmless if it ever disappears.
        if getattr(reader, "_limit", READER_BUFFER_LIMIT) < READER_BUFFER_LIMIT:
            reader._limit = READER_BUFFER_LIMIT

    # ------------------------------------------------------------------ reading

    def _idle(self, what: str, received_before: int) -> Refusal:
        """The TIMEOUT of a read that waited `idle_timeout_s`; `congested` when our other
        streams received CONGESTED_BYTES meanwhile (a stalling peer is cut all the same)."""
        others = self.counters.bytes_received - received_before
        if others >= CONGESTED_BYTES:
            return Refusal(Reason.TIMEOUT, f"no {what} for {self.idle_timeout_s:.0f} s while {others} "
                           f"bytes came on other streams (our link is saturated)", congested=True)
        return Refusal(Reason.TIMEOUT, f"no {what} for {self.idle_timeout_s:.0f} s")

    async def read_exactly(self, n: int) -> bytes:
        received_before = self.counters.bytes_received
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                data = await self.reader.readexactly(n)
        except asyncio.IncompleteReadError as error:
            self.counters.bytes_received += len(error.partial)
            raise Refusal(Reason.TRUNCATED, f"stream ended after {len(error.partial)} of {n} bytes") from None
        except TimeoutError:
            raise self._idle("data", received_before) from None
        self.counters.bytes_received += n
        return data

    async def read_frame_head(self, max_header_bytes: int) -> tuple[bytes, bytes]:
        """Read a frame's header and signature; a status instead raises PeerStatus.

        The declared header length is checked before reading it, so an oversized claim costs
        us five bytes of reading and nothing else.
        """
        tag = await self.read_exactly(1)
        if tag == TAG_STATUS:
            reason, detail = await self._read_status_body()
            raise PeerStatus(reason, detail)
        if tag != TAG_FRAME:
            raise Refusal(Reason.MALFORMED, f"expected a frame or a status, got tag {tag!r}")
        (header_len,) = FRAME_PREFIX.unpack(tag + await self.read_exactly(FRAME_PREFIX.size - 1))[1:]
        if header_len > max_header_bytes:
            raise Refusal(Reason.TOO_LARGE, f"header of {header_len} bytes exceeds {max_header_bytes}")
        rest = await self.read_exactly(header_len + SIGNATURE_BYTES)
        return rest[:header_len], rest[header_len:]

    async def read_status(self) -> tuple[Reason, str]:
        tag = await self.read_exactly(1)
        if tag != TAG_STATUS:
            raise Refusal(Reason.MALFORMED, f"expected a status, got tag {tag!r}")
        return await self._read_status_body()

    async def _read_status_body(self) -> tuple[Reason, str]:
        _, code, detail_len = STATUS_PREFIX.unpack(TAG_STATUS + await self.read_exactly(STATUS_PREFIX.size - 1))
        if detail_len > MAX_STATUS_DETAIL_BYTES:
            raise Refusal(Reason.MALFORMED, f"status detail of {detail_len} bytes exceeds {MAX_STATUS_DETAIL_BYTES}")
        return decode_status_body(code, await self.read_exactly(detail_len) if detail_len else b"")

    async def read_payload_into(self, destination: memoryview, expected_digest: bytes) -> asyncio.Future:
        """Fill `destination` from the stream, hashing in a worker thread as bytes arrive.

        Returns once every byte is read, with a future that completes when the last bytes are
        hashed and raises Refusal(BAD_DIGEST) on a mismatch: the caller reads the next frame
        meanwhile instead of idling while the tail is hashed.
        """
        loop = asyncio.get_running_loop()
        hasher = wire.new_payload_hasher()
        size, filled, hashed = len(destination), 0, 0
        pending: asyncio.Future | None = None
        try:
            while filled < size:
                received_before = self.counters.bytes_received
                try:
                    async with asyncio.timeout(self.idle_timeout_s):
                        chunk = await self.reader.read(min(size - filled, READ_BYTES))
                except TimeoutError:
                    raise self._idle("payload data", received_before) from None
                if not chunk:
                    raise Refusal(Reason.TRUNCATED, f"stream ended after {filled} of {size} payload bytes")
                destination[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
                self.counters.bytes_received += len(chunk)
                # One hashing job at a time keeps update() calls in order; while it runs we keep
                # reading, and the next job takes everything that arrived meanwhile.
                if filled - hashed >= HASH_BATCH_BYTES and (pending is None or pending.done()):
                    if pending is not None:
                        await pending
                    pending = loop.run_in_executor(self.executor, hasher.update, destination[hashed:filled])
                    hashed = filled
        except BaseException:
            if pending is not None and not pending.done():
                # Cancelled or failed mid-payload: the thread still reads the buffer, so wait for
                # it (milliseconds) before the caller drops the buffer.
                await asyncio.shield(pending)
            raise

        async def verify() -> None:
            if pending is not None:
                await pending
            if filled > hashed:
                await loop.run_in_executor(self.executor, hasher.update, destination[hashed:filled])
            if hasher.digest() != expected_digest:
                raise Refusal(Reason.BAD_DIGEST, "payload does not match its signed digest")

        verification = asyncio.ensure_future(verify())
        verification.add_done_callback(lambda f: f.cancelled() or f.exception())  # the caller reports it
        return verification

    # ------------------------------------------------------------------ writing

    async def write(self, data: bytes | memoryview) -> None:
        self.writer.write(data)
        self.counters.bytes_sent += len(data)
        await self._drain()

    async def write_views(self, views: Iterable[memoryview], chunk_bytes: int) -> None:
        """Write consecutive views, draining every `chunk_bytes` so memory stays bounded."""
        pending = 0
        for view in views:
            for start in range(0, len(view), chunk_bytes):
                piece = view[start:start + chunk_bytes]
                self.writer.write(piece)
                pending += len(piece)
                self.counters.bytes_sent += len(piece)
                if pending >= chunk_bytes:
                    await self._drain()
                    pending = 0
        if pending:
            await self._drain()

    async def write_status(self, reason: Reason, detail: str = "") -> None:
        await self.write(encode_status(reason, detail))

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                await self.writer.drain()
        except TimeoutError:
            raise Refusal(Reason.TIMEOUT, f"peer read nothing for {self.idle_timeout_s:.0f} s") from None

    async def linger(self, timeout_s: float = 2.0, max_bytes: int = 8 << 20) -> None:
        """Read and drop what the peer still sends, until it closes (bounded in time and bytes).

        Closing a stream with unread data makes p2pd reset it, and a reset can overtake the
        status we just wrote; lingering lets the peer read our refusal and close first.
        """
        dropped = 0
        with suppress(Exception):
            async with asyncio.timeout(timeout_s):
                while dropped < max_bytes:
                    chunk = await self.reader.read(READ_BYTES)
                    if not chunk:
                        return
                    dropped += len(chunk)
                    self.counters.bytes_received += len(chunk)

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # already closed or broken: nothing left to release
            pass
