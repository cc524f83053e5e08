"""The training thread of the daemon: inner steps, and every H steps the round's outer step.

The thread owns the InnerTrainer and the protocol's outer state; the event loop owns the
network. They meet only through a `RoundPolicy`, whose `end_round` runs here and talks to the
loop through thread-safe calls that never wait on the network in `overlap` timing (and wait at
most a deadline in `blocking` timing). The round counter is derived, never stored apart:
round = completed inner steps // H.

Invariants:
- a stop request is honoured between inner steps: a step is never cut;
- a checkpoint is written at the end of every `checkpoint_rounds`-th round and on stop, so a
  restart resumes with the same trainer, outer state and round;
- every event handed to `emit` is a plain dict (it crosses to the event loop).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from node.train.trainer import InnerTrainer, pad_step

log = logging.getLogger(__name__)


class RoundPolicy(Protocol):
    """The protocol-specific end of a round (NoLoCo or DiLoCoX), run in the training thread."""

    def between_steps(self, round_index: int) -> dict[str, Any] | None:
        """Called after every inner step that does not end a round (must be cheap); returns
        an event to report, if any."""

    def end_round(self, round_index: int) -> dict[str, Any]:
        """Applies the outer step, leaves θ = the new φ, and returns fields to report."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingWorker(threading.Thread):
    def __init__(self, trainer: InnerTrainer, policy: RoundPolicy, inner_steps: int,
                 total_steps: int, emit: Callable[[dict], None],
                 save_checkpoint: Callable[[], None], eval_every_rounds: int = 1,
                 checkpoint_rounds: int = 1, min_step_seconds: float = 0.0):
        """`eval_every_rounds` / `checkpoint_rounds` of 0: never between rounds."""
        super().__init__(name="lowcomm-training", daemon=True)
        self.trainer, self.policy = trainer, policy
        self.inner_steps, self.total_steps = inner_steps, total_steps
        self.emit, self.save_checkpoint = emit, save_checkpoint
        self.eval_every_rounds, self.checkpoint_rounds = eval_every_rounds, checkpoint_rounds
        self.stop_requested = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.tokens = 0
        self.compute_seconds = 0.0
        self.min_step_seconds = min_step_seconds

    @property
    def round_index(self) -> int:
        return self.trainer.step // self.inner_steps

    def request_stop(self) -> None:
        self.stop_requested.set()

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported to the loop, which exits with the reason
            self.error = exc
            log.error("training thread failed: %s\n%s", exc, traceback.format_exc())
            self.emit({"event": "failed", "error": f"{exc.__class__.__name__}: {exc}"})
        finally:
            self.finished.set()

    def _loop(self) -> None:
        trainer = self.trainer
        round_started = time.monotonic()
        while trainer.step < self.total_steps and not self.stop_requested.is_set():
            result = trainer.train_step()
            self.tokens += result.tokens
            self.compute_seconds += result.seconds
            self.emit({"event": "step", "step": result.step, "round": self.round_index,
                       "loss": result.loss, "lr": result.lr,
                       "tokens_per_second": result.tokens / result.seconds})
            pad_step(result.seconds, self.min_step_seconds, self.stop_requested.wait)
            if trainer.step % self.inner_steps:
                event = self.policy.between_steps(self.round_index)
                if event is not None:
                    self.emit(event)
                continue
            finished_round = trainer.step // self.inner_steps - 1
            compute = time.monotonic() - round_started
            outer_started = time.monotonic()
            report = self.policy.end_round(finished_round)
            event = {"event": "round", "round": finished_round, "step": trainer.step,
                     "round_seconds": compute, "outer_seconds": time.monotonic() - outer_started,
                     **report}
            if self.eval_every_rounds and (finished_round + 1) % self.eval_every_rounds == 0:
                val = trainer.evaluate()
                event.update(val_loss=val, perplexity=math.exp(min(val, 50.0)))
            self.emit(event)
            if self.checkpoint_rounds and (finished_round + 1) % self.checkpoint_rounds == 0:
                self.save_checkpoint()
            round_started = time.monotonic()
        if self.stop_requested.is_set():
            self.emit({"event": "stopping", "step": trainer.step})
        self.save_checkpoint()
        self.emit({"event": "trained", "step": trainer.step, "tokens": self.tokens,
                   "compute_seconds": self.compute_seconds})
