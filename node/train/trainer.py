"""The inner trainer of docs/protocols.md §0: AdamW, clipping, warm-up then cosine, accumulation.

One object per node. It owns the live model (the fast weights θ), the inner optimizer (never
sent, never averaged, never reset between rounds) and the node's batch stream. The outer
protocols read and overwrite θ through `named_parameters()` and `load_parameters()`; the
trainer knows nothing of them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.config.schema import ModelConfig, TrainConfig
from node.data.corpus import BatchStream, Corpus, validation_batches
from node.events import DeviceUse
from node.train.accelerator import (PROBE_HEADROOM, LossFunction, MicroBatchFit, autocast,
                                    device_precision, probe_micro_batch, smaller_micro_batch)
from node.train.model import Decoder, build_model

log = logging.getLogger(__name__)


def pick_device(requested: str = "auto") -> torch.device:
    """cuda, then mps, then cpu; a named device that is missing is an error, not a fallback.
    `cuda:N` names one GPU (one daemon per GPU); an index this machine lacks is an error."""
    available = {"cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None
                 and torch.backends.mps.is_available(),
                 "cpu": True}
    if requested == "auto":
        return torch.device(next(name for name, ok in available.items() if ok))
    kind, _, index = requested.partition(":")
    if not available.get(kind, False):
        raise RuntimeError(f"train.device = '{requested}' is not available on this machine: "
                           f"use 'auto' or 'cpu'")
    if index and int(index) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise RuntimeError(f"train.device = '{requested}' names GPU {index}, and this machine has "
                           f"{count} (0-{count - 1}): pick one of those")
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
    """A step is `tokens_per_step` tokens: `accumulation` batches of the manifest's
    micro_batch_size drawn from the stream (the stream's positions are the swarm's unit, so a
    checkpoint's position means the same on every machine), run through the model as
    `rows / micro_batch` micro-batches of `micro_batch` sequences, the size this device fits
    (node/train/accelerator.py). The loss of each is divided by their count, so every split
    accumulates the same mean gradient up to rounding; at the manifest's size the micro-batches
    are the stream's batches themselves."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, corpus: Corpus,
                 seq_len: int, stream_seed: int, device: torch.device | None = None):
        self.cfg, self.corpus, self.seq_len = train_cfg, corpus, seq_len
        self.device = device or pick_device(train_cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # kernels, pinned copies and compilation on our GPU
        vocab = model_cfg.vocab_size or corpus.vocab_size
        if vocab < corpus.vocab_size:
            raise ValueError(f"model.vocab_size = {vocab} is smaller than the data's vocabulary "
                             f"{corpus.vocab_size}: set it to 0 to take the data's")
        self.precision = device_precision(self.device, train_cfg.precision)
        torch.manual_seed(train_cfg.seed)  # same initial weights on every node of a run
        self.model: Decoder = build_model(model_cfg, vocab, self.device)
        self.model.activation_checkpointing = train_cfg.activation_checkpointing
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
            weight_decay=train_cfg.weight_decay, fused=self.device.type == "cuda" or None)
        self.scaler = (torch.amp.GradScaler(self.device.type) if self.precision.loss_scaling
                       else None)
        decay = train_cfg.decay_steps or train_cfg.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, train_cfg.warmup_steps, decay, train_cfg.min_lr_ratio))
        self.micro_tokens = train_cfg.micro_batch_size * seq_len
        self.accumulation = train_cfg.tokens_per_step // self.micro_tokens
        self.rows = train_cfg.tokens_per_step // seq_len  # sequences a step
        self.stream = BatchStream(corpus.train, seq_len, train_cfg.micro_batch_size, stream_seed)
        self.step = 0
        self.loss_fn = LossFunction(self.model, train_cfg.compile, self.device.type)
        self.fit = MicroBatchFit(train_cfg.micro_batch_size, None, "the manifest's micro_batch_size")
        probe = train_cfg.micro_batch_probe
        if probe == "on" or (probe == "auto" and self.device.type == "cuda"):
            self.fit = self.probe_micro_batch()
        self.micro_batch = self.fit.size

    # ------------------------------------------------------------------ training
    def _autocast(self):
        return autocast(self.device, self.precision)

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _trial(self, size: int) -> int | None:
        """One eager forward and backward of `size` random sequences: the device's peak memory
        in bytes (0 off CUDA), or None where it ran out of memory. Leaves no gradient behind."""
        generator = torch.Generator().manual_seed(size)
        tokens = torch.randint(0, self.model.vocab_size, (size, self.seq_len + 1), generator=generator)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with self._autocast():
                loss = self.model.loss(self._to_device(tokens[:, :-1]), self._to_device(tokens[:, 1:]))
            self._backward(loss)
            return torch.cuda.max_memory_allocated(self.device) if cuda else 0
        except torch.OutOfMemoryError:
            return None
        finally:
            loss = None
            self.model.zero_grad(set_to_none=True)

    def probe_micro_batch(self) -> MicroBatchFit:
        """The largest micro-batch (an even split of a step's sequences) that fits the device
        with PROBE_HEADROOM of its memory to spare beside what other processes hold (another
        daemon on the same GPU); logged in one sentence."""
        limit = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            limit = torch.cuda.memory_allocated(self.device) + int(free - PROBE_HEADROOM * total)
        self.model.train()
        fit = probe_micro_batch(self._trial, self.rows, limit)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        peak = f", peak {fit.peak_bytes / 2**30:.2f} GiB" if fit.peak_bytes else ""
        log.info("micro-batch %d sequences (%d a step in %d micro-batches%s): %s.",
                 fit.size, self.rows, self.rows // fit.size, peak, fit.reason)
        return fit

    def _micro_batches(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        if self.micro_batch == self.cfg.micro_batch_size:
            return batches
        tokens, targets = (torch.cat(parts) for parts in zip(*batches))
        return list(zip(tokens.split(self.micro_batch), targets.split(self.micro_batch)))

    def _forward_backward(self, batches) -> torch.Tensor:
        chunks = self._micro_batches(batches)
        total = torch.zeros((), device=self.device)
        for tokens, targets in chunks:
            tokens, targets = self._to_device(tokens), self._to_device(targets)
            with self._autocast():
                loss = self.loss_fn(tokens, targets) / len(chunks)
            self._backward(loss)
            total += loss.detach()
        return total

    def accumulate_gradients(self) -> torch.Tensor:
        """Forward and backward over one step's tokens; returns the mean loss as a tensor (no
        device sync here). The simulator's data-parallel averages the gradients it leaves (an
        fp32 device's: fp16 leaves them loss-scaled). Out of memory: the micro-batch is halved
        and the step's same tokens run again; a compilation that fails: the same, eager."""
        self.model.train()
        batches = [self.stream.next() for _ in range(self.accumulation)]
        while True:
            try:
                return self._forward_backward(batches)
            except torch.OutOfMemoryError:
                pass  # handled below, once the error's frames (and their tensors) are released
            except Exception as error:
                self.model.zero_grad(set_to_none=True)
                if not self.loss_fn.fall_back(error):
                    raise
                continue
            self._halve_micro_batch()

    def _halve_micro_batch(self) -> None:
        self.model.zero_grad(set_to_none=True)
        smaller = smaller_micro_batch(self.micro_batch, self.rows)
        if smaller is None:
            raise torch.OutOfMemoryError(f"out of memory at a micro-batch of one sequence: this "
                                         f"device cannot train this model at data.seq_len = "
                                         f"{self.seq_len}")
        log.warning("out of memory at a micro-batch of %d sequences, so step %d runs again with "
                    "the same %d tokens in micro-batches of %d.", self.micro_batch, self.step + 1,
                    self.rows * self.seq_len, smaller)
        self.micro_batch = smaller
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def train_step(self) -> StepResult:
        started = time.perf_counter()
        total = self.accumulate_gradients()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient
        if self.cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.model.parameters() if p.grad is not None])
        lr = self.optimizer.param_groups[0]["lr"]
        if self.scaler:  # skips the update where the scaled gradients overflowed
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
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

    def device_use(self) -> DeviceUse:
        """How this trainer uses its device now, for the status view and the log."""
        return DeviceUse(precision=self.precision.describe(), compute=self.loss_fn.describe(),
                         micro_batch=self.micro_batch)

    def device_use_changed(self, last: DeviceUse) -> DeviceUse | None:
        """The device use now where it differs from `last` (a fall-back, a halving), else None."""
        now = self.device_use()
        return None if now.fields() == last.fields() else now

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
                "rng": rng, **({"scaler": self.scaler.state_dict()} if self.scaler else {})}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.stream.seed = int(state["stream_seed"])
        self.stream.position = int(state["stream_position"])
        torch.set_rng_state(state["rng"]["cpu"])
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
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
