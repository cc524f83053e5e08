"""Reassembly of one incoming message from frames that arrive over several parallel streams.

An `Assembly` exists from the first checked frame header of a message until the message is
complete or has failed. It owns the receive buffer (allocated once, after the header passed
every bound and the bytes were reserved in the `InflightLedger`), checks that every frame
belongs to the message and arrives on its stream in order, and fails as a whole: a bad frame
on one stream cancels the readers of the others, drops the buffer and releases the
reservation. A timer on its `Progress` (p2p/progress.py) does the same for a message that stalls
or cannot finish in time, whose streams may not all have an operation pending (one that never
opens); a message that keeps moving at the swarm's minimum link rate is never cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

import numpy as np
from hivemind.p2p import PeerID

from p2p.errors import Reason, Refusal
from p2p.messages import ReceivedMessage
from p2p.progress import Progress
from p2p.wire import MessageHeader


class Assembly:
    """Frames of one message (sender, nonce) being received."""

    def __init__(self, sender: PeerID, first: MessageHeader, progress: Progress, release: Callable[[], None],
                 on_expired: Callable[[Refusal], None] | None = None):
        """`progress`: of the exchange the message belongs to; `on_expired(refusal)`: told when
        its verdict, not a stream, failed the message (no stream's handler sees that failure
        first, so the receiver counts it there)."""
        self.sender = sender
        self.first = first
        self.key = first.message_key()
        self.tensors = first.tensors
        # np.empty: pages are touched only as bytes arrive, so a reservation costs no time.
        self._buffer: np.ndarray | None = np.empty(first.total, dtype=np.uint8)
        self._view: memoryview | None = memoryview(self._buffer)
        self._next_frame: dict[int, int] = {}          # stream index -> next frame index it must carry
        self._frames_left = first.frames
        self._release = release
        self.readers: set[asyncio.Task] = set()        # cancelled if the message fails
        self.side_tasks: set[asyncio.Task] = set()     # reply production, delivery: cancelled on failure
        self.complete: asyncio.Future[ReceivedMessage] = asyncio.get_running_loop().create_future()
        self.complete.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
        self.outcome: asyncio.Future[tuple[Reason, str]] = asyncio.get_running_loop().create_future()
        # A swap's reply (set by the transport's reply task); failing the message fails it too.
        self.reply: asyncio.Future = asyncio.get_running_loop().create_future()
        self.reply.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.failure: Refusal | None = None
        self.on_expired = on_expired
        self.progress = progress
        self._timer: asyncio.TimerHandle | None = None
        self._arm()
        # `on_finished()` runs once, when the exchange is over: every stream that joined has
        # ended (sent its part, read the statuses, or broken), or the message failed with none.
        self.on_finished: Callable[[], None] | None = None
        self._streams_serving = 0

    def stream_started(self) -> None:
        self._streams_serving += 1

    def stream_ended(self) -> None:
        self._streams_serving -= 1
        if self._streams_serving == 0:
            self._finish()

    def _finish(self) -> None:
        finished, self.on_finished = self.on_finished, None
        if finished is not None:
            finished()

    @property
    def done(self) -> bool:
        return self.complete.done()

    def attach_stream(self, header: MessageHeader) -> int:
        """Register a new stream by its first frame; return the stream's index."""
        self._check_same_message(header)
        stream = header.frame
        if stream >= header.streams or stream in self._next_frame:
            raise Refusal(Reason.MALFORMED, f"frame {header.frame} cannot open a stream of this message")
        if header.tensors != self.tensors:
            raise Refusal(Reason.MALFORMED, "streams of one message disagree on its tensor manifest")
        self._next_frame[stream] = stream
        return stream

    def destination(self, stream: int, header: MessageHeader) -> memoryview:
        """Where frame `header` goes, after checking it is the frame this stream owes next."""
        self._check_same_message(header)
        if header.frame != self._next_frame.get(stream):
            raise Refusal(Reason.MALFORMED, f"frame {header.frame} arrived where frame "
                                            f"{self._next_frame.get(stream)} was due")
        if header.tensors is not None and header.tensors != self.tensors:
            raise Refusal(Reason.MALFORMED, "frames of one message disagree on its tensor manifest")
        if self._view is None:
            raise self.failure or Refusal(Reason.INTERNAL, "message buffer already released")
        self._next_frame[stream] += header.streams
        return self._view[header.offset:header.offset + header.length]

    def frame_done(self) -> None:
        """Record one verified frame; the last one completes the message."""
        self._frames_left -= 1
        if self._frames_left == 0 and not self.done:
            self._timer.cancel()
            message = ReceivedMessage(self.sender, self.first, self.tensors or (), self._view)
            self._buffer = self._view = None   # the message owns the memory now
            self._release()
            self.complete.set_result(message)

    def fail(self, refusal: Refusal) -> bool:
        """Abandon the message: cancel its readers and side tasks, free the buffer, release bytes.

        Returns True if this call failed the message (False: it had already completed or failed).
        """
        if self.done:
            return False
        self.failure = refusal
        self._timer.cancel()
        self.complete.set_exception(refusal)
        if not self.reply.done():
            self.reply.set_exception(refusal)
        if not self.outcome.done():
            self.outcome.set_result((refusal.reason, refusal.detail))
        current = asyncio.current_task()
        for task in (*self.readers, *self.side_tasks):
            if task is not current:
                task.cancel()
        self._buffer = self._view = None
        self._release()
        if self._streams_serving == 0:
            self._finish()
        return True

    def _arm(self) -> None:
        now = self.progress.clock()
        self._timer = asyncio.get_running_loop().call_later(self.progress.next_check(now) - now, self._check)

    def _check(self) -> None:
        if self.done:
            return
        refusal = self.progress.verdict(self.progress.clock())
        if refusal is None:
            self._arm()
        elif self.fail(refusal) and self.on_expired is not None:
            self.on_expired(refusal)

    def _check_same_message(self, header: MessageHeader) -> None:
        if header.message_key() != self.key:
            raise Refusal(Reason.MALFORMED, "frame header disagrees with the message it claims to belong to")


class BoundWork:
    """A stream's reading or writing, run as a task the assembly cancels if the message fails.

    Awaiting it raises the assembly's failure in that case. `stop()` cancels it and returns
    once the task has let go of the stream: only then may the stream be read by anyone else
    (a refusal's linger) or closed. The task's error is always retrieved: the assembly's
    failure, or whoever awaits this, reports it."""

    def __init__(self, assembly: Assembly, coroutine: Coroutine):
        self.assembly = assembly
        self.task = asyncio.create_task(coroutine)
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        assembly.readers.add(self.task)

    def __await__(self):
        return self._result().__await__()

    async def _result(self) -> None:
        try:
            await asyncio.wait({self.task})
        except asyncio.CancelledError:
            await self.stop()
            raise
        if self.task.cancelled():
            raise self.assembly.failure or Refusal(Reason.INTERNAL, "stream work cancelled")
        self.task.result()

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.wait({self.task})
