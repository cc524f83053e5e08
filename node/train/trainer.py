"""The inner trainer of docs/protocols.md §0: AdamW, clipping, warm-up then cosine, accumulation.

One object per node. It owns the live model (the fast weights θ), the inner optimizer (never
sent, never averaged, never reset between rounds) and the node's batch stream. The outer
protocols read and overwrite θ through `named_parameters()` and `load_parameters()`; the
trainer knows nothing of them.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.config.schema import ModelConfig, TrainConfig
from node.data.corpus import BatchStream, Corpus, validation_batches
from node.train.model import Decoder, build_model


def pick_device(requested: str = "auto") -> torch.device:
    """cuda, then mps, then cpu; a named device that is missing is an error, not a fallback."""
    available = {"cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None
                 and torch.backends.mps.is_available(),
                 "cpu": True}
    if requested == "auto":
        return torch.device(next(name for name, ok in available.items() if ok))
    if not available.get(requested, False):
        raise RuntimeError(f"train.device = '{requested}' is not available on this machine: "
                           f"use 'auto' or 'cpu'")
    return torch.device(requested)


def lr_factor(step: int, warmup: int, decay_steps: int, floor: float) -> float:
    """Linear warm-up to 1, then cosine decay to `floor` at decay_steps (and flat after)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, decay_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepResult:
    step: int          # inner steps completed, this one included
    loss: float        # mean training loss over the accumulated micro-batches
    lr: float
    grad_norm: float
    tokens: int        # tokens consumed by this step
    seconds: float


class InnerTrainer:
    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, corpus: Corpus,
                 seq_len: int, stream_seed: int, device: torch.device | None = None):
        self.cfg, self.corpus, self.seq_len = train_cfg, corpus, seq_len
        self.device = device or pick_device(train_cfg.device)
        vocab = model_cfg.vocab_size or corpus.vocab_size
        if vocab < corpus.vocab_size:
            raise ValueError(f"model.vocab_size = {vocab} is smaller than the data's vocabulary "
                             f"{corpus.vocab_size}: set it to 0 to take the data's")
        torch.manual_seed(train_cfg.seed)  # same initial weights on every node of a run
        self.model: Decoder = build_model(model_cfg, vocab, self.device)
        self.model.activation_checkpointing = train_cfg.activation_checkpointing
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
            weight_decay=train_cfg.weight_decay, fused=self.device.type == "cuda" or None)
        decay = train_cfg.decay_steps or train_cfg.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, train_cfg.warmup_steps, decay, train_cfg.min_lr_ratio))
        self.micro_tokens = train_cfg.micro_batch_size * seq_len
        self.accumulation = train_cfg.tokens_per_step // self.micro_tokens
        self.stream = BatchStream(corpus.train, seq_len, train_cfg.micro_batch_size, stream_seed)
        self.step = 0

    # ------------------------------------------------------------------ training
    def _autocast(self):
        # bf16 autocast on CUDA only (docs/protocols.md §0); fp32 elsewhere.
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def accumulate_gradients(self) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; returns the mean loss as a tensor
        (no device sync here). The simulator's data-parallel averages the gradients it leaves."""
        self.model.train()
        total = torch.zeros((), device=self.device)
        for _ in range(self.accumulation):
            tokens, targets = (self._to_device(t) for t in self.stream.next())
            with self._autocast():
                loss = self.model.loss(tokens, targets) / self.accumulation
            loss.backward()
            total += loss.detach()
        return total

    def train_step(self) -> StepResult:
        started = time.perf_counter()
        total = self.accumulate_gradients()
        if self.cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.model.parameters() if p.grad is not None])
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return StepResult(self.step, float(total), lr, float(grad_norm),
                          self.accumulation * self.micro_tokens, time.perf_counter() - started)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats per token) on the fixed validation batches."""
        self.model.eval()
        losses = []
        for tokens, targets in validation_batches(self.corpus.val, self.seq_len,
                                                  self.cfg.micro_batch_size, self.cfg.eval_batches):
            with self._autocast():
                losses.append(float(self.model.loss(self._to_device(tokens),
                                                    self._to_device(targets))))
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ outer protocol access
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """θ by name, live: what the outer protocols read and overwrite."""
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def host_parameters(self) -> dict[str, torch.Tensor]:
        """θ by name in host memory, for DiLoCoX, whose agreed state (φ, momentum, error
        feedback) lives on the host so that nodes on different accelerators compute it bitwise
        alike (and 16 bytes a parameter stay off the accelerator). On the CPU it is the live
        parameters (the protocol copies what it keeps); on CUDA, fresh copies through pinned
        memory, all queued before one wait."""
        params = self.named_parameters()
        if self.device.type == "cpu":
            return params
        pinned = self.device.type == "cuda"
        copies = {name: torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned)
                  for name, p in params.items()}
        for name, p in params.items():
            copies[name].copy_(p, non_blocking=pinned)
        if pinned:
            torch.cuda.current_stream(self.device).synchronize()
        return copies

    @torch.no_grad()
    def load_parameters(self, values: dict[str, torch.Tensor]) -> None:
        for name, p in self.model.named_parameters():
            p.copy_(values[name])

    def start_at(self, step: int) -> None:
        """Moves to the swarm's position: step counter and learning-rate schedule. The optimizer
        state is kept (a late joiner's is fresh anyway; a node catching up keeps its own), and
        batches keep coming from this node's own stream (its position is its own business).
        """
        self.step = step
        self.scheduler.last_epoch = step
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                       self.scheduler.lr_lambdas):
            group["lr"] = base * factor(step)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step,
                "stream_position": self.stream.position, "stream_seed": self.stream.seed,
                "rng": rng}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.stream.seed = int(state["stream_seed"])
        self.stream.position = int(state["stream_position"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)


def pad_step(step_seconds: float, min_step_seconds: float, wait: Callable[[float], object]) -> float:
    """train.min_step_seconds: idles out the rest of a step that took `step_seconds`, through
    `wait` (a stop event's wait, so that a stop request ends the pause); returns the pause."""
    pause = min_step_seconds - step_seconds
    if pause <= 0:
        return 0.0
    wait(pause)
    return pause
