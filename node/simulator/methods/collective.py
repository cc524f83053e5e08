"""The baselines that move whole fp32 vectors by a ring all-reduce, and local training.

- data-parallel: the mean gradient of all replicas before every optimizer step;
- DiLoCo (docs/protocols.md §2): H local steps, then every replica applies the mean Δ of all;
- local: H local steps, nothing exchanged (the no-communication baseline).
"""

from __future__ import annotations

import torch

from node.simulator.methods.base import Method
from node.train.trainer import InnerTrainer
from protocol.diloco import DiLoCo, DiLoCoHyperParameters
from protocol.tensors import numel

FP32_BYTES = 4


class LocalOnly(Method):
    """Every replica trains alone on its own stream; a round is only an evaluation interval."""

    def run_round(self, round_index: int) -> None:
        self.inner_phase()


class DiLoCoBaseline(Method):
    """One protocol.diloco.DiLoCo per replica; all apply the same mean Δ, so φ stays identical."""

    def __init__(self, settings, replicas, exchange) -> None:
        super().__init__(settings, replicas, exchange)
        hyper = DiLoCoHyperParameters(settings.outer_lr, settings.outer_momentum)
        self.outer = {r.name: DiLoCo(r.trainer.named_parameters(), hyper) for r in replicas}
        self.vector_elements = numel(replicas[0].trainer.named_parameters())

    def run_round(self, round_index: int) -> None:
        self.inner_phase()
        # Canonical order (sorted ids, as DiLoCoX sums its messages): bitwise equal means.
        ordered = sorted(self.replicas, key=lambda r: r.name)
        deltas = [self.outer[r.name].pseudo_gradient(r.trainer.named_parameters()) for r in ordered]
        self.exchange.ring_allreduce(self.vector_elements, FP32_BYTES)
        for replica in self.replicas:
            replica.load(self.outer[replica.name].outer_step(deltas))


class DataParallel(Method):
    """Synchronous data-parallel: a gradient all-reduce before every optimizer step.

    InnerTrainer.train_step does backward, clipping and the optimizer step in one call, so the
    average cannot happen inside it. This drives each trainer's own model, stream, optimizer and
    scheduler from outside, in train_step's order, with the average between backward and
    clipping (so the clip sees the global gradient, as in real data-parallel training).
    tests/unit/test_simulator.py checks that one replica reproduces train_step bit for bit.
    """

    def __init__(self, settings, replicas, exchange) -> None:
        super().__init__(settings, replicas, exchange)
        self.vector_elements = numel(replicas[0].trainer.named_parameters())

    def run_round(self, round_index: int) -> None:
        losses = []
        for _ in range(self.settings.inner_steps):
            losses.extend(backward(replica.trainer) for replica in self.replicas)
            self._average_gradients()
            self.exchange.ring_allreduce(self.vector_elements, FP32_BYTES)
            for replica in self.replicas:
                optimizer_step(replica.trainer)
        self.exchange.compute(self.settings.inner_steps)
        self.round_train_losses = losses

    @torch.no_grad()
    def _average_gradients(self) -> None:
        parameters = [list(r.trainer.model.parameters()) for r in self.replicas]
        for same_parameter in zip(*parameters):
            mean = torch.stack([p.grad for p in same_parameter]).mean(dim=0)
            for p in same_parameter:
                p.grad.copy_(mean)


def backward(trainer: InnerTrainer) -> float:
    """The gradient of one optimizer step's batch, accumulated as InnerTrainer.train_step does."""
    return float(trainer.accumulate_gradients())


def optimizer_step(trainer: InnerTrainer) -> None:
    """Clip, step, clear, schedule: the rest of InnerTrainer.train_step."""
    if trainer.cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.cfg.grad_clip)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.scheduler.step()
    trainer.step += 1
