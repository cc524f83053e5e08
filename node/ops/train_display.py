"""What `lowcomm-node train` shows: a rich progress bar on a terminal, plain lines otherwise.

It only subscribes to the training loop's events (node/events.py); it holds no training logic.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from node.events import (CheckpointSkipped, DeviceUse, Evaluated, Event, StepDone, Stopping, TrainingDone,
                         TrainingStarted)


class TrainDisplay:
    def __init__(self, log_every: int, console: Console | None = None):
        self.console = console or Console(stderr=False)
        self.interactive = self.console.is_terminal
        self.log_every = log_every
        self.progress: Progress | None = None
        self.task = None
        self.last_val = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()

    def _line(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def __call__(self, event: Event) -> None:
        if isinstance(event, TrainingStarted):
            resumed = f", resumed from {event.resumed_from}" if event.resumed_from else ""
            self._line(f"corpus: {event.corpus}")
            self._line(f"model: {event.parameters:,} parameters on {event.device} "
                       f"({event.threads} threads), step {event.step} of {event.steps}{resumed}")
            if self.interactive:
                self.progress = Progress(
                    TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                    console=self.console, transient=False)
                self.progress.start()
                self.task = self.progress.add_task("train", total=event.steps,
                                                   completed=event.step, status="")
        elif isinstance(event, DeviceUse):
            self._line(f"device use: {event.precision}; {event.compute}; micro-batch "
                       f"{event.micro_batch} sequences")
        elif isinstance(event, StepDone):
            status = f"loss {event.loss:.3f}  lr {event.lr:.2e}  {event.tokens_per_second:,.0f} tok/s"
            if self.last_val is not None:
                status += f"  val {self.last_val:.3f}"
            if self.progress is not None:
                self.progress.update(self.task, completed=event.step, status=status)
            elif event.step % self.log_every == 0:
                self._line(f"step {event.step}: {status}")
        elif isinstance(event, Evaluated):
            self.last_val = event.val_loss
            self._line(f"step {event.step}: validation loss {event.val_loss:.4f} nats/token,"
                       f" perplexity {event.perplexity:.2f}")
        elif isinstance(event, CheckpointSkipped):
            self._line(f"warning: {event.reason}")
        elif isinstance(event, Stopping):
            self._line(f"{event.signal} received: finished step {event.step}, writing a checkpoint")
        elif isinstance(event, TrainingDone):
            self._line(f"done at step {event.step}: validation loss {event.val_loss:.4f}, "
                       f"{event.tokens_per_second:,.0f} tokens/s")


def error(message: str) -> None:
    print(f"lowcomm-node: error: {message}", file=sys.stderr)
