"""One node, no network: `lowcomm-node train`, the no-communication baseline.

The loop trains, validates, checkpoints and resumes; it reports typed events (node/events.py)
to a metrics log (JSON lines in the data directory) and to any subscriber given (the terminal
display, node/ops/train_display.py). SIGINT/SIGTERM finish the current step, write a checkpoint
and return normally.
"""

from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from node.config.schema import Config
from node.data.corpus import load_corpus, stream_seed
from node.data_dir import DataDir, MetricsLog
from node.events import (Checkpointed, CheckpointSkipped, EventBus, Evaluated, Handler, StepDone,
                         Stopping, TrainingDone, TrainingStarted)
from node.train.checkpoint import CheckpointStore
from node.train.model import count_parameters
from node.train.trainer import InnerTrainer, pad_step, pick_device

CHECKPOINT_FORMAT = 1


@dataclass
class RunSummary:
    steps: int
    final_val_loss: float
    tokens_per_second: float
    resumed_from: str | None
    stopped_early: bool


class StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it between steps, so a step is never cut."""

    def __init__(self):
        self.event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()


def checkpoint_state(cfg: Config, trainer: InnerTrainer, corpus_digest: str) -> dict:
    return {"format": CHECKPOINT_FORMAT, "config": cfg.to_dict(), "corpus_digest": corpus_digest,
            "trainer": trainer.state_dict()}


def check_resumable(state: dict, cfg: Config, corpus_digest: str, path: Path) -> None:
    """Refuses a checkpoint of another model shape or another corpus, in one sentence."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise RuntimeError(f"checkpoint {path.name} has format {state.get('format')!r}, this "
                           f"version reads {CHECKPOINT_FORMAT}: use a fresh node.data_dir")
    saved = state["config"]["model"]
    for key, value in cfg.to_dict()["model"].items():
        if key != "preset" and saved.get(key) != value:
            raise RuntimeError(f"checkpoint {path.name} was trained with model.{key} = "
                               f"{saved.get(key)!r}, this config says {value!r}: use the same "
                               f"model or a fresh node.data_dir")
    if state["corpus_digest"] != corpus_digest:
        raise RuntimeError(f"checkpoint {path.name} was trained on another corpus (digest "
                           f"{state['corpus_digest'][:16]} vs {corpus_digest[:16]}): use the "
                           f"same data or a fresh node.data_dir")


def run_training(cfg: Config, identity: bytes, subscribers: list[Handler] = (),
                 stop: StopFlag | None = None) -> RunSummary:
    data_dir = DataDir(cfg.node.data_dir)
    store = CheckpointStore(data_dir.checkpoints)
    store.remove_stale_temporaries()
    metrics = MetricsLog(data_dir.metrics)
    events = EventBus()
    for subscriber in (metrics, *subscribers):
        events.subscribe(subscriber)

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if stop is None:  # not `stop or ...`: an unset StopFlag is falsy
        stop = StopFlag()
    try:
        corpus = load_corpus(cfg.data)
        device = pick_device(cfg.train.device)
        trainer = InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len,
                               stream_seed(identity, cfg.train.seed), device)
        loaded = store.load_latest()
        for reason in loaded.skipped if loaded else []:
            events.publish(CheckpointSkipped(reason=reason))
        if loaded:
            check_resumable(loaded.state, cfg, corpus.digest, loaded.path)
            trainer.load_state_dict(loaded.state["trainer"])
        events.publish(TrainingStarted(
            corpus=corpus.summary(), corpus_digest=corpus.digest, device=str(device),
            parameters=count_parameters(trainer.model), threads=torch.get_num_threads(),
            step=trainer.step, steps=cfg.train.steps,
            resumed_from=loaded.path.name if loaded else None))
        device_use = trainer.device_use()
        events.publish(device_use)

        def save() -> None:
            path = store.save(checkpoint_state(cfg, trainer, corpus.digest), trainer.step)
            events.publish(Checkpointed(step=trainer.step, path=path.name))

        def evaluate(step: int) -> float:
            val = trainer.evaluate()
            events.publish(Evaluated(step=step, val_loss=val, perplexity=math.exp(val)))
            return val

        val_loss, tokens, seconds = math.nan, 0, 0.0
        while trainer.step < cfg.train.steps and not stop:
            result = trainer.train_step()
            if changed := trainer.device_use_changed(device_use):
                device_use = changed
                events.publish(changed)
            tokens += result.tokens
            seconds += result.seconds
            events.publish(StepDone(step=result.step, round=None, loss=result.loss, lr=result.lr,
                                    grad_norm=result.grad_norm,
                                    tokens_per_second=result.tokens / result.seconds))
            pad_step(result.seconds, cfg.train.min_step_seconds, stop.event.wait)
            if cfg.train.eval_every and result.step % cfg.train.eval_every == 0:
                val_loss = evaluate(result.step)
            if cfg.train.checkpoint_every and result.step % cfg.train.checkpoint_every == 0:
                save()
        if stop:
            events.publish(Stopping(signal=stop.signal_name, step=trainer.step))
        elif not (cfg.train.eval_every and trainer.step % cfg.train.eval_every == 0):
            val_loss = evaluate(trainer.step)
        save()
        rate = tokens / seconds if seconds else 0.0
        events.publish(TrainingDone(step=trainer.step, val_loss=val_loss, tokens_per_second=rate))
        return RunSummary(trainer.step, val_loss, rate, loaded.path.name if loaded else None,
                          bool(stop))
    finally:
        metrics.close()
