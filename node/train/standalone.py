"""One node, no network: `lowcomm-node train`, the no-communication baseline.

The loop trains, validates, checkpoints and resumes; what it reports goes to a metrics log
(JSON lines in the data directory) and to any display that listens. SIGINT/SIGTERM finish the
current step, write a checkpoint and return normally.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from node.train.checkpoint import CheckpointStore
from node.config.schema import Config
from node.data.corpus import load_corpus, stream_seed
from node.train.model import count_parameters
from node.train.trainer import InnerTrainer, pad_step, pick_device

CHECKPOINT_FORMAT = 1
Event = dict
Listener = Callable[[Event], None]


@dataclass
class RunSummary:
    steps: int
    final_val_loss: float
    tokens_per_second: float
    resumed_from: str | None
    stopped_early: bool


class MetricsLog:
    """Append-only JSON lines: one object per event, flushed so a SIGKILL loses at most one."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def __call__(self, event: Event) -> None:
        self.file.write(json.dumps(event) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


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


def run_training(cfg: Config, identity: bytes, listeners: list[Listener] = (),
                 stop: StopFlag | None = None) -> RunSummary:
    data_dir = Path(cfg.node.data_dir)
    store = CheckpointStore(data_dir / "checkpoints")
    store.remove_stale_temporaries()
    metrics = MetricsLog(data_dir / "metrics.jsonl")
    emit_to = [metrics, *listeners]

    def emit(kind: str, **fields) -> None:
        event = {"event": kind, "time": time.time(), **fields}
        for listener in emit_to:
            listener(event)

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
            emit("checkpoint_skipped", reason=reason)
        if loaded:
            check_resumable(loaded.state, cfg, corpus.digest, loaded.path)
            trainer.load_state_dict(loaded.state["trainer"])
        emit("start", corpus=corpus.summary(), corpus_digest=corpus.digest, device=str(device),
             parameters=count_parameters(trainer.model), threads=torch.get_num_threads(),
             step=trainer.step, steps=cfg.train.steps,
             resumed_from=loaded.path.name if loaded else None)

        def save() -> None:
            path = store.save(checkpoint_state(cfg, trainer, corpus.digest), trainer.step)
            emit("checkpoint", step=trainer.step, path=path.name)

        val_loss, tokens, seconds = math.nan, 0, 0.0
        while trainer.step < cfg.train.steps and not stop:
            result = trainer.train_step()
            tokens += result.tokens
            seconds += result.seconds
            emit("step", step=result.step, loss=result.loss, lr=result.lr,
                 grad_norm=result.grad_norm, tokens_per_second=result.tokens / result.seconds)
            pad_step(result.seconds, cfg.train.min_step_seconds, stop.event.wait)
            if cfg.train.eval_every and result.step % cfg.train.eval_every == 0:
                val_loss = trainer.evaluate()
                emit("eval", step=result.step, val_loss=val_loss, perplexity=math.exp(val_loss))
            if cfg.train.checkpoint_every and result.step % cfg.train.checkpoint_every == 0:
                save()
        if stop:
            emit("stopping", step=trainer.step, signal=stop.signal_name)
        elif not (cfg.train.eval_every and trainer.step % cfg.train.eval_every == 0):
            val_loss = trainer.evaluate()
            emit("eval", step=trainer.step, val_loss=val_loss, perplexity=math.exp(val_loss))
        save()
        rate = tokens / seconds if seconds else 0.0
        emit("done", step=trainer.step, val_loss=val_loss, tokens_per_second=rate)
        return RunSummary(trainer.step, val_loss, rate, loaded.path.name if loaded else None,
                          bool(stop))
    finally:
        metrics.close()
