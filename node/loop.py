"""The daemon's event loop and its two kinds of helpers: work started in the background, and the
training thread's calls into the loop.

- `BackgroundTasks`: every fire-and-forget task of the daemon is started here; a task that fails
  is counted by name and logged in one sentence (and published as a TaskFailed event), never
  dropped with its future. Cancellation, at leaving, is not a failure. A task started as a
  `transfer` (a message on its way to a peer) is let finish, bounded, before the node stops
  serving: cut mid-stream, the peer would see a truncated message from an orderly leave.
- `LoopBridge`: the training thread's only way into the loop. `call` runs a function on the loop
  and waits for its answer, at most the network wait the caller asks for plus a named timeout
  (NodeTimeouts.loop_call_s), or, for a wait the loop bounds itself (a swap that ends by its
  progress, p2p/progress.py), as long as the loop answers a no-op within that timeout; `post`
  and `spawn` hand work over without waiting.

Invariant: the training thread never touches loop objects directly, and never waits on a loop
that has stopped answering.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from node.events import Event, TaskFailed

log = logging.getLogger("lowcomm.tasks")


class BackgroundTasks:
    def __init__(self, publish: Callable[[Event], None] | None = None):
        self.publish = publish
        self.failures: Counter = Counter()  # task name -> failures
        self._tasks: set[asyncio.Task] = set()
        self._transfers: set[asyncio.Task] = set()

    def spawn(self, coroutine: Coroutine, name: str, *, transfer: bool = False) -> asyncio.Task:
        """Runs `coroutine` on the running loop; its failure is counted and logged.
        `transfer`: it sends to a peer, and leaving waits for it (`finish_transfers`)."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        if transfer:
            self._transfers.add(task)
        task.add_done_callback(self._finished)
        return task

    async def finish_transfers(self, timeout_s: float) -> None:
        """Waits (bounded) for the transfers in flight to end; cancels nothing."""
        if self._transfers:
            await asyncio.wait(list(self._transfers), timeout=timeout_s)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._transfers.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        name, error = task.get_name(), task.exception()
        self.failures[name] += 1
        sentence = f"{type(error).__name__}: {error}"
        log.error("background task %r failed (%d so far): %s", name, self.failures[name], sentence)
        if self.publish is not None:
            self.publish(TaskFailed(task=name, error=sentence))

    async def stop(self, timeout_s: float) -> None:
        """Cancels what still runs and waits (bounded) for it to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)


class LoopBridge:
    def __init__(self, loop: asyncio.AbstractEventLoop, tasks: BackgroundTasks, timeout_s: float):
        self.loop, self.tasks, self.timeout_s = loop, tasks, timeout_s

    def call(self, what: str, function: Callable[..., Any], *args: Any, wait_s: float | None = 0.0) -> Any:
        """`function(*args)` on the loop (a coroutine function is awaited there); its result.

        Raises RuntimeError naming `what` when the loop has not answered after `wait_s` (the
        network wait the caller asked for) plus the bridge's timeout. `wait_s` None: the wait is
        bounded on the loop's side (a transfer that ends by its progress, p2p/progress.py); the
        bridge then only checks, every timeout, that the loop still answers.
        """
        async def run() -> Any:
            result = function(*args)
            return await result if inspect.isawaitable(result) else result
        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        limit = self.timeout_s if wait_s is None else wait_s + self.timeout_s
        while True:
            try:
                return future.result(timeout=limit)
            except concurrent.futures.TimeoutError:
                if wait_s is None and self._answers():
                    continue
                future.cancel()
                raise RuntimeError(f"the event loop did not answer {what} within {limit:.0f} s: it "
                                   f"is stalled or stopping") from None

    def _answers(self) -> bool:
        """Whether the loop runs a no-op within the bridge's timeout."""
        ping = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop)
        try:
            ping.result(timeout=self.timeout_s)
            return True
        except concurrent.futures.TimeoutError:
            ping.cancel()
            return False

    def post(self, function: Callable[..., Any], *args: Any) -> None:
        """`function(*args)` on the loop, soon; the caller does not wait."""
        self.loop.call_soon_threadsafe(function, *args)

    def spawn(self, name: str, function: Callable[..., Coroutine], *args: Any,
              transfer: bool = False) -> None:
        """Starts `function(*args)` as a background task on the loop; the caller does not wait."""
        self.loop.call_soon_threadsafe(lambda: self.tasks.spawn(function(*args), name,
                                                                transfer=transfer))
