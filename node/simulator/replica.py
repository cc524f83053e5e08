"""A simulated node: a name and an InnerTrainer on its own batch stream, all sharing one corpus."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from node.config.schema import ModelConfig, TrainConfig
from node.data.corpus import Corpus, stream_seed
from node.train.trainer import InnerTrainer
from protocol.tensors import NamedTensors, fp32_clone


def replica_name(index: int) -> str:
    """The replica's node id, and the identity its batch-stream seed is derived from."""
    return f"replica-{index}"


@dataclass
class Replica:
    name: str
    trainer: InnerTrainer

    def train(self, steps: int) -> list[float]:
        """`steps` inner steps; returns their training losses."""
        return [self.trainer.train_step().loss for _ in range(steps)]

    def weights(self) -> NamedTensors:
        """A detached fp32 copy of θ."""
        return fp32_clone(self.trainer.named_parameters(), what=f"{self.name} weights")

    def load(self, weights: NamedTensors) -> None:
        """θ ← weights (the start of the next round)."""
        self.trainer.load_parameters(weights)

    @property
    def learning_rate(self) -> float:
        return self.trainer.optimizer.param_groups[0]["lr"]


def build_replicas(count: int, model_cfg: ModelConfig, train_cfg: TrainConfig, corpus: Corpus,
                   seq_len: int, seed: int, device: torch.device) -> list[Replica]:
    """`count` replicas with identical initial weights (the trainer seeds them with
    train_cfg.seed) and distinct batch streams stream_seed("replica-i", seed)."""
    train_cfg = copy.deepcopy(train_cfg)
    train_cfg.seed = seed
    replicas = []
    for index in range(count):
        name = replica_name(index)
        trainer = InnerTrainer(model_cfg, train_cfg, corpus, seq_len,
                               stream_seed(name.encode(), seed), device)
        replicas.append(Replica(name, trainer))
    return replicas


@torch.no_grad()
def weight_spread(weights: list[NamedTensors]) -> float:
    """How far replicas' weights are apart, relative to their size:

        sqrt( mean_i ‖w_i − w̄‖² ) / ‖w̄‖     over all tensors together (0 when all are equal).
    """
    if len(weights) < 2:
        return 0.0
    squared_distance, squared_norm = 0.0, 0.0
    for name in weights[0]:
        stacked = torch.stack([w[name].double() for w in weights])
        centre = stacked.mean(dim=0)
        squared_distance += float((stacked - centre).square().sum()) / len(weights)
        squared_norm += float(centre.square().sum())
    return math.sqrt(squared_distance) / math.sqrt(squared_norm) if squared_norm else 0.0
