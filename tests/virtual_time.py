"""An asyncio event loop on virtual time, for unit tests of code that waits on the loop's clock.

`run(main())` runs a coroutine as `asyncio.run` does, on a `VirtualTimeLoop`: `loop.time()`
starts at 0 and moves only when the loop would otherwise sleep, straight to its next timer, so
`asyncio.sleep(3600)`, `wait_for(..., 30)` and `call_later(10, ...)` take no wall-clock time and
a test asserts exactly what the code's waits are (the way BanList and NewcomerGate take a
clock), never a window of wall-clock time.

Rules: ready callbacks and I/O always run before time moves; while a thread started by
`run_in_executor` is at work, time moves with the wall clock (the thread's work is real), so a
thread's result is never skipped past by a virtual timeout. With no timer and no thread, the
loop waits on its real selector (I/O, or a thread's wake-up) as any loop does.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine
from typing import Any


class _VirtualSelector:
    """The loop's selector: a real one, whose waits move the virtual clock instead of sleeping."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualTimeLoop):
        self._real, self._loop = real, loop

    def select(self, timeout: float | None = None):
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if self._loop.threads_at_work or timeout is None:
            began = time.monotonic()
            events = self._real.select(timeout)
            self._loop.now += time.monotonic() - began
            return events
        self._loop.now += timeout  # nothing to do before the next timer: jump to it
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        self.threads_at_work = 0
        super().__init__(_VirtualSelector(selectors.DefaultSelector(), self))

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor, func, *args):
        future = super().run_in_executor(executor, func, *args)
        self.threads_at_work += 1

        def done(_future) -> None:
            self.threads_at_work -= 1
        future.add_done_callback(done)
        return future


def run(main: Coroutine) -> Any:
    """`asyncio.run(main)` on a fresh VirtualTimeLoop; the loop is closed after."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            pending = asyncio.all_tasks(loop)  # what asyncio.run leaves behind: cancelled
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
