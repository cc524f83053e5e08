"""The replicas' ends of a round, run together: each replica's `end_round` in a thread of its own,
one thread at a time.

A round class's link may need every replica's message before it can answer (a blocking NoLoCo
pair, DiLoCoX's group): it then calls `rendezvous(action)`, which lets the others run until all
have arrived, runs `action` once (the in-memory network's exchange of the round), and resumes
them. Only one replica computes at any moment (a baton passes between the threads), so a run
uses one core, and what a replica computes depends only on the actions, never on thread order:
the simulation stays deterministic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

RENDEZVOUS_TIMEOUT_S = 600.0  # a replica that never arrives is a bug: fail, do not hang


class Lockstep:
    def __init__(self, replicas: int):
        self.replicas = replicas
        self.pool = ThreadPoolExecutor(replicas, thread_name_prefix="replica")
        self.baton = threading.Lock()
        self._action: Callable[[], None] | None = None
        self.barrier = threading.Barrier(replicas, action=self._run_action)

    def run(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Runs every call (one per replica) to its end; their results, in order."""
        if len(calls) != self.replicas:
            raise ValueError(f"lockstep runs {self.replicas} replicas, got {len(calls)} calls")

        def one(call: Callable[[], Any]) -> Any:
            with self.baton:
                try:
                    return call()
                except BaseException:
                    self.barrier.abort()  # the others must not wait for this one
                    raise
        futures = [self.pool.submit(one, call) for call in calls]
        wait(futures)
        if self.barrier.broken:
            self.barrier.reset()
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:  # the replica that failed, rather than those it left waiting
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                       errors[0])
        return [future.result() for future in futures]

    def rendezvous(self, action: Callable[[], None]) -> None:
        """From inside a call: waits for every replica to arrive here; `action` (the same for
        every replica) runs once, before any of them goes on."""
        self._action = action
        self.baton.release()
        try:
            self.barrier.wait(RENDEZVOUS_TIMEOUT_S)
        finally:
            self.baton.acquire()

    def _run_action(self) -> None:
        action, self._action = self._action, None
        if action is not None:
            action()

    def close(self) -> None:
        self.pool.shutdown(wait=False)
