"""The training thread of the daemon: inner steps, and every H steps the round's outer step.

The thread owns the InnerTrainer and the protocol's outer state; the event loop owns the
network. They meet only through the round (a RoundPolicy, node/rounds/policy.py), whose
`between_steps` and `end_round` run here and talk to the loop through its link, which never
waits on the network in `overlap` timing (and waits at most a deadline in `blocking` timing).
The round counter is derived, never stored apart: round = completed inner steps // H.

Invariants:
- a stop request is honoured between inner steps: a step is never cut;
- a checkpoint is written at the end of every `checkpoint_every`-th step's round and on stop,
  so a restart resumes with the same trainer, outer state and round;
- every event is handed to `publish`, which carries it to the event loop.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections.abc import Callable

from node.config.schema import TrainConfig
from node.events import Event, Failed, RoundEnded, StepDone, Stopping, Trained
from node.rounds.policy import RoundPolicy
from node.train.trainer import InnerTrainer, pad_step

log = logging.getLogger(__name__)


def every_rounds(steps: int, inner_steps: int) -> int:
    """A cadence in steps (eval_every, checkpoint_every) as rounds; 0 keeps its meaning: never
    during training."""
    return max(1, steps // inner_steps) if steps else 0


class TrainingWorker(threading.Thread):
    def __init__(self, config: TrainConfig, inner_steps: int, trainer: InnerTrainer,
                 policy: RoundPolicy, *, total_steps: int, publish: Callable[[Event], None],
                 save_checkpoint: Callable[[], None], peers_alive: Callable[[], int]):
        """`total_steps`: stop after this inner step; `peers_alive`: the members seen alive, for
        the round's report."""
        super().__init__(name="lowcomm-training", daemon=True)
        self.trainer, self.policy, self.inner_steps = trainer, policy, inner_steps
        self.total_steps, self.min_step_seconds = total_steps, config.min_step_seconds
        self.eval_every_rounds = every_rounds(config.eval_every, inner_steps)
        self.checkpoint_rounds = every_rounds(config.checkpoint_every, inner_steps)
        self.publish, self.save_checkpoint, self.peers_alive = publish, save_checkpoint, peers_alive
        self.stop_requested = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.tokens = 0
        self.compute_seconds = 0.0

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
            self.publish(Failed(error=f"{exc.__class__.__name__}: {exc}"))
        finally:
            self.finished.set()

    def _loop(self) -> None:
        trainer = self.trainer
        round_started = time.monotonic()
        between = 0.0  # this round's time in the protocol's between_steps
        while trainer.step < self.total_steps and not self.stop_requested.is_set():
            asked = time.monotonic()
            event = self.policy.between_steps(self.round_index)
            between += time.monotonic() - asked
            if event is not None:
                self.publish(event)
            result = trainer.train_step()
            self.tokens += result.tokens
            self.compute_seconds += result.seconds
            self.publish(StepDone(step=result.step, round=self.round_index, loss=result.loss,
                                  lr=result.lr, grad_norm=result.grad_norm,
                                  tokens_per_second=result.tokens / result.seconds))
            pad_step(result.seconds, self.min_step_seconds, self.stop_requested.wait)
            if trainer.step % self.inner_steps:
                continue
            finished_round = trainer.step // self.inner_steps - 1
            compute = time.monotonic() - round_started
            outer_started = time.monotonic()
            outcome = self.policy.end_round(finished_round)
            outer = time.monotonic() - outer_started
            val = None
            if self.eval_every_rounds and (finished_round + 1) % self.eval_every_rounds == 0:
                val = trainer.evaluate()
            self.publish(RoundEnded(round=finished_round, step=trainer.step, round_seconds=compute,
                                    outer_seconds=outer, outcome=outcome,
                                    peers_alive=self.peers_alive(), val_loss=val,
                                    perplexity=None if val is None else math.exp(min(val, 50.0)),
                                    between_steps_seconds=between))
            if self.checkpoint_rounds and (finished_round + 1) % self.checkpoint_rounds == 0:
                self.save_checkpoint()
            round_started, between = time.monotonic(), 0.0
        if self.stop_requested.is_set():
            self.publish(Stopping(step=trainer.step))
        self.save_checkpoint()
        self.publish(Trained(step=trainer.step, tokens=self.tokens,
                             compute_seconds=self.compute_seconds))
