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
- a thread that fails writes its checkpoint too when its state is consistent (`consistent`):
  not inside an inner step, and not inside a call of the round that was changing θ or the
  outer state (the round says so by its `consistent` attribute; a round without one counts as
  changing state throughout its calls), so a failure never leaves a half-applied step on disk;
- every event is handed to `publish`, which carries it to the event loop.

`round_end_beside` (DiLoCoX, `join --round-end beside`): at a round's end the thread copies θ to
the host and trains on while the protocol's end of that round (message, outer step, digest) runs
in a thread beside it; when it is done, at the next step boundary, θ is shifted by what the
round's end moved its start, so the steps trained meanwhile keep their progress. Invariants
there: the protocol's state is touched by one thread at a time (no `between_steps` while a
round's end runs beside), a round's end finishes before the next one starts, before a
checkpoint and before the thread stops, and an error in it fails the thread as it would inline;
the time a round's end waited for members still training its round (`ran_ahead_seconds`: this
node ran ahead of them) holds training as long, as it does inline: otherwise a node ahead drifts
further ahead round after round, beyond the one round its peers' messages are waited for, and
then refuses them all (a CI run of tests/integration/test_dilocox_catch_up.py[beside]: one node
of three applied only its own messages for 27 rounds).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from node.config.schema import TrainConfig
from node.events import Event, Failed, RoundEnded, StepDone, Stopping, Trained
from node.rounds.policy import RoundPolicy
from node.train.trainer import InnerTrainer, pad_step
from protocol.tensors import shift_in_place

log = logging.getLogger(__name__)


def every_rounds(steps: int, inner_steps: int) -> int:
    """A cadence in steps (eval_every, checkpoint_every) as rounds; 0 keeps its meaning: never
    during training."""
    return max(1, steps // inner_steps) if steps else 0


@dataclass
class _RoundBeside:
    """A round's end running beside training."""

    round: int
    compute: float       # the round's inner steps, seconds
    between: float       # its time in between_steps
    held: float          # how long the training thread was held to start it (θ to the host)
    future: Future


class TrainingWorker(threading.Thread):
    def __init__(self, config: TrainConfig, inner_steps: int, trainer: InnerTrainer,
                 policy: RoundPolicy, *, total_steps: int, publish: Callable[[Event], None],
                 save_checkpoint: Callable[[], None], peers_alive: Callable[[], int],
                 round_end_beside: bool = False):
        """`total_steps`: stop after this inner step; `peers_alive`: the members seen alive, for
        the round's report; `round_end_beside`: see the module's docstring (the policy must
        have `end_round_beside`)."""
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
        self.beside_pool = ThreadPoolExecutor(1, "lowcomm-round-end") if round_end_beside else None
        self.beside: _RoundBeside | None = None
        self._in_step = False    # inside an inner step: θ and the optimizer are half-changed
        self._in_round = False   # inside a call of the round (see `consistent`)

    @property
    def consistent(self) -> bool:
        """Whether the trainer's and the round's state may be written as a checkpoint now."""
        if self._in_step or self.beside is not None:  # θ is not shifted by a round's end beside yet
            return False
        round_consistent = getattr(self.policy, "consistent", None)
        return not self._in_round if round_consistent is None else bool(round_consistent)

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
            self._checkpoint_after_failure()
            self.publish(Failed(error=f"{exc.__class__.__name__}: {exc}"))
        finally:
            if self.beside_pool is not None:
                self.beside_pool.shutdown(wait=True)
            self.finished.set()

    def _checkpoint_after_failure(self) -> None:
        if not self.consistent:
            log.warning("no checkpoint after the failure: it came while the state was changing")
            return
        try:
            self.save_checkpoint()
        except Exception as exc:  # the failure is what gets reported; this is logged beside it
            log.error("the checkpoint after the failure could not be written: %s", exc)

    def _loop(self) -> None:
        trainer = self.trainer
        device_use = trainer.device_use()
        self.publish(device_use)
        round_started = time.monotonic()
        between = 0.0  # this round's time in the protocol's between_steps
        while trainer.step < self.total_steps and not self.stop_requested.is_set():
            if self.beside is not None and self.beside.future.done():
                self._finish_beside()
            if self.beside is None:  # the protocol's state is this thread's alone
                asked = time.monotonic()
                self._in_round = True
                event = self.policy.between_steps(self.round_index)
                self._in_round = False
                between += time.monotonic() - asked
                if event is not None:
                    self.publish(event)
            self._in_step = True
            result = trainer.train_step()
            self._in_step = False
            if changed := trainer.device_use_changed(device_use):
                device_use = changed
                self.publish(changed)
            self.tokens += result.tokens
            self.compute_seconds += result.seconds
            self.publish(StepDone(step=result.step, round=self.round_index, loss=result.loss,
                                  lr=result.lr, grad_norm=result.grad_norm,
                                  tokens_per_second=result.tokens / result.seconds))
            pad_step(result.seconds, self.min_step_seconds, self.stop_requested.wait)
            if trainer.step % self.inner_steps:
                continue
            compute = time.monotonic() - round_started
            if self.beside_pool is not None:
                if self.beside is not None:  # the last round's end first: a catch-up in it
                    self._finish_beside()     # moves the step counter to the swarm's round
                self._start_beside(trainer.step // self.inner_steps - 1, compute, between)
                round_started, between = time.monotonic(), 0.0
                continue
            finished_round = trainer.step // self.inner_steps - 1
            outer_started = time.monotonic()
            self._in_round = True
            outcome = self.policy.end_round(finished_round)
            self._in_round = False
            self._report(finished_round, trainer.step, compute, time.monotonic() - outer_started,
                         outcome, between)
            round_started, between = time.monotonic(), 0.0
        if self.beside is not None:
            self._finish_beside()
        if self.stop_requested.is_set():
            self.publish(Stopping(step=trainer.step))
        self.save_checkpoint()
        self.publish(Trained(step=trainer.step, tokens=self.tokens,
                             compute_seconds=self.compute_seconds))

    def _report(self, finished_round: int, step: int, compute: float, outer: float, outcome,
                between: float) -> None:
        """A round's end is done: evaluate and checkpoint when due, and say so."""
        val = None
        if self.eval_every_rounds and (finished_round + 1) % self.eval_every_rounds == 0:
            val = self.trainer.evaluate()
        self.publish(RoundEnded(round=finished_round, step=step,
                                round_seconds=compute, outer_seconds=outer, outcome=outcome,
                                peers_alive=self.peers_alive(), val_loss=val,
                                perplexity=None if val is None else math.exp(min(val, 50.0)),
                                between_steps_seconds=between))
        if self.checkpoint_rounds and (finished_round + 1) % self.checkpoint_rounds == 0:
            self.save_checkpoint()

    # ------------------------------------------------------------------ a round's end beside
    def _start_beside(self, finished_round: int, compute: float, between: float) -> None:
        held = time.monotonic()
        theta = self.trainer.host_parameters()
        if self.trainer.device.type == "cpu":  # the live parameters: training goes on in them
            theta = {name: t.detach().clone() for name, t in theta.items()}
        future = self.beside_pool.submit(self.policy.end_round_beside, finished_round, theta)
        self.beside = _RoundBeside(finished_round, compute, between, time.monotonic() - held,
                                   future)

    def _finish_beside(self) -> None:
        """Waits for the round's end beside (if it still runs), shifts θ by what it moved the
        round's start, follows the swarm's round if it caught up, and reports the round."""
        held = time.monotonic()
        item = self.beside
        outcome, shift, next_round = item.future.result()  # its error fails this thread
        # what inline would have waited for members behind us, less what we waited here already
        self.stop_requested.wait(max(0.0, outcome.ran_ahead_seconds - (time.monotonic() - held)))
        shift_in_place(self.trainer.named_parameters(), shift)
        if next_round is not None:  # the steps trained beside it count in the swarm's round
            trained = self.trainer.step - (item.round + 1) * self.inner_steps
            self.trainer.start_at(next_round * self.inner_steps + trained)
        self.beside = None
        self._report(item.round, (item.round + 1) * self.inner_steps, item.compute,
                     item.held + time.monotonic() - held, outcome, item.between)
