"""An asyncio event loop on virtual time, for unit tests of code that waits on the loop's clock
(the DiLoCoX exchange: its `clock` is the loop's time, and its waits are the loop's timers).

Rule: the clock starts at 0 and moves only when no callback is ready and no work handed to a
thread (`run_in_executor`) is outstanding; it then jumps to the earliest live timer. So a test
reads exact durations (a wait of one round takes exactly that round), however loaded the
machine, and a test that waits 30 virtual seconds takes milliseconds. A loop with nothing
scheduled and nothing outstanding blocks as a real one does.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Coroutine
from typing import Any


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._in_threads = 0

    def time(self) -> float:
        return self._now

    def run_in_executor(self, executor, func, *args):
        self._in_threads += 1
        future = super().run_in_executor(executor, func, *args)
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _future) -> None:
        self._in_threads -= 1

    def _run_once(self) -> None:
        # drop cancelled timers at the head, as the base loop does, so that the clock never
        # jumps to a timer nobody waits for
        while self._scheduled and self._scheduled[0]._cancelled:
            self._timer_cancelled_count -= 1
            heapq.heappop(self._scheduled)._scheduled = False
        if not self._ready and self._scheduled and not self._in_threads:
            self._now = max(self._now, self._scheduled[0]._when)
        super()._run_once()


def run_virtual(main: Coroutine) -> Any:
    """`asyncio.run(main)` on a VirtualTimeLoop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


run = run_virtual  # the name asyncio.run has
