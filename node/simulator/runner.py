"""Runs one simulation: N replicas, one method, round after round, measured after every round."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from node.config.schema import Config
from node.data.corpus import Corpus, load_corpus
from node.simulator.exchange import InMemoryExchange
from node.simulator.methods import METHODS, Method
from node.simulator.replica import build_replicas, weight_spread
from node.simulator.settings import SimulationSettings
from node.train.trainer import pick_device
from protocol.tensors import numel, weights_digest


@dataclass
class RoundRecord:
    """The state of the swarm after `round` rounds (cumulative counts since the start)."""

    round: int
    inner_steps: int                 # per replica
    tokens_per_replica: int
    val_loss_mean: float | None      # None: not evaluated this round (see eval_every)
    val_loss_min: float | None
    val_loss_max: float | None
    train_loss: float                # mean over replicas and this round's steps
    lr: float                        # inner learning rate at the end of the round
    bytes_sent_per_replica: float    # mean over replicas
    bytes_sent_max: int              # the replica that sent most
    weight_spread: float             # replica.weight_spread of the replicas' weights
    simulated_steps: int             # the exchange's clock: compute plus idle, in inner steps
    idle_steps: int
    messages_sent: int
    messages_dropped: int
    messages_late: int
    local_updates: int
    resyncs: int
    energy_kept: float | None = None  # DiLoCoX low-rank: mean energy kept ε of this round's messages
    phi_digests: int = 0             # DiLoCoX: distinct φ digests among the replicas (1: agreed)
    pairs: list[list[str]] = field(default_factory=list)  # NoLoCo: this round's pairs
    wall_seconds: float = 0.0


@dataclass
class SimulationResult:
    method: str
    settings: dict[str, Any]
    config: dict[str, Any]
    parameters: int
    records: list[RoundRecord]

    @property
    def final(self) -> RoundRecord:
        return self.records[-1]

    @property
    def final_val_loss(self) -> float:
        return next(r.val_loss_mean for r in reversed(self.records) if r.val_loss_mean is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "settings": self.settings, "config": self.config,
                "parameters": self.parameters, "model_bytes_fp32": 4 * self.parameters,
                "final_val_loss": self.final_val_loss,
                "rounds": [dataclasses.asdict(r) for r in self.records]}


def simulation_config(config: Config, settings: SimulationSettings) -> Config:
    """The node config the replicas train with: its cosine schedule spans the whole run."""
    config = dataclasses.replace(config, train=dataclasses.replace(config.train))
    config.train.steps = settings.total_inner_steps
    return config


class Simulation:
    """The replicas, the exchange and the method of one run, built and ready to run.

    `run_simulation` is the usual entry; tests build a Simulation to look inside afterwards.
    """

    def __init__(self, settings: SimulationSettings, config: Config, corpus: Corpus | None = None):
        self.settings = settings.validated()
        self.config = simulation_config(config, self.settings)
        if self.config.train.threads:
            torch.set_num_threads(self.config.train.threads)
        corpus = corpus if corpus is not None else load_corpus(self.config.data)
        replicas = build_replicas(self.settings.workers, self.config.model, self.config.train, corpus,
                                  self.config.data.seq_len, self.settings.seed,
                                  pick_device(self.config.train.device))
        exchange = InMemoryExchange([r.name for r in replicas], self.settings.latency_steps,
                                    self.settings.drop_probability, self.settings.seed)
        self.method: Method = METHODS[self.settings.protocol](self.settings, replicas, exchange)

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> SimulationResult:
        settings, config = self.settings, self.config
        started = time.perf_counter()
        records = []
        for round_index in range(settings.rounds):
            self.method.run_round(round_index)
            last = round_index == settings.rounds - 1
            if last:
                self.method.finish(settings.rounds)
            evaluate = last or (round_index + 1) % settings.eval_every == 0
            record = measure(self.method, round_index + 1, config.train.tokens_per_step, evaluate,
                             time.perf_counter() - started)
            records.append(record)
            if on_round is not None:
                on_round(record)
        return SimulationResult(settings.describe(), dataclasses.asdict(settings),
                                {"model": dataclasses.asdict(config.model),
                                 "data": dataclasses.asdict(config.data),
                                 "train": dataclasses.asdict(config.train)},
                                numel(self.method.replicas[0].trainer.named_parameters()), records)


def run_simulation(settings: SimulationSettings, config: Config, corpus: Corpus | None = None,
                   on_round: Callable[[RoundRecord], None] | None = None) -> SimulationResult:
    """Train `settings.workers` replicas with `settings.protocol` for `settings.rounds` rounds."""
    return Simulation(settings, config, corpus).run(on_round)


def measure(method: Method, rounds_done: int, tokens_per_step: int, evaluate: bool,
            wall_seconds: float) -> RoundRecord:
    weights = method.replica_weights()
    losses = evaluate_replicas(method, weights) if evaluate else []
    exchange, counters = method.exchange, method.counters
    steps = rounds_done * method.settings.inner_steps
    train_losses = method.round_train_losses
    return RoundRecord(
        round=rounds_done, inner_steps=steps, tokens_per_replica=steps * tokens_per_step,
        val_loss_mean=sum(losses) / len(losses) if losses else None,
        val_loss_min=min(losses) if losses else None, val_loss_max=max(losses) if losses else None,
        train_loss=sum(train_losses) / len(train_losses) if train_losses else float("nan"),
        lr=method.replicas[0].learning_rate,
        bytes_sent_per_replica=exchange.mean_bytes_sent(),
        bytes_sent_max=max(exchange.bytes_sent.values()),
        weight_spread=weight_spread(weights), simulated_steps=exchange.now,
        idle_steps=exchange.idle_steps, messages_sent=exchange.counters.messages_sent,
        messages_dropped=exchange.counters.messages_dropped,
        messages_late=counters.late_messages, local_updates=counters.local_updates,
        resyncs=counters.resyncs, energy_kept=counters.energy_kept,
        phi_digests=counters.phi_digests,
        pairs=[list(p) for p in counters.pairs_last_round],
        wall_seconds=wall_seconds)


def evaluate_replicas(method: Method, weights: list[dict[str, torch.Tensor]]) -> list[float]:
    """Validation loss of every replica. Replicas with bitwise equal weights have equal losses
    (the validation batches are fixed), so each distinct set of weights is evaluated once."""
    by_digest: dict[str, float] = {}
    losses = []
    for replica, replica_weights in zip(method.replicas, weights):
        digest = weights_digest(replica_weights)
        if digest not in by_digest:
            by_digest[digest] = replica.trainer.evaluate()
        losses.append(by_digest[digest])
    return losses
