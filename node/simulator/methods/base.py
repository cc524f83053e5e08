"""What every simulated method shares: the replicas, the exchange, counters, the inner phase."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from node.simulator.exchange import InMemoryExchange
from node.simulator.replica import Replica
from node.simulator.settings import SimulationSettings
from protocol.tensors import NamedTensors


@dataclass
class MethodCounters:
    """Running totals beyond the exchange's own; the runner reports them every round."""

    local_updates: int = 0       # NoLoCo outer steps with no partner snapshot (G = {i})
    late_messages: int = 0       # arrived after the round they were needed in: not applied
    resyncs: int = 0             # DiLoCoX nodes that re-downloaded φ and m from the majority
    energy_kept: float | None = None  # DiLoCoX low-rank: mean ε of the last round's messages
    phi_digests: int = 0         # DiLoCoX: distinct φ digests at the last round's end (1: agreed)
    pairs_last_round: list[tuple[str, str]] = field(default_factory=list)


class Method(ABC):
    """One round of one protocol over all replicas, in lockstep."""

    def __init__(self, settings: SimulationSettings, replicas: list[Replica],
                 exchange: InMemoryExchange) -> None:
        self.settings, self.replicas, self.exchange = settings, replicas, exchange
        self.counters = MethodCounters()
        self.round_train_losses: list[float] = []

    def inner_phase(self, steps: int | None = None, continues: bool = False) -> None:
        """`steps` (default H) inner steps on every replica, one after another (they are all at
        the same time); `continues`: the second part of a round split in two."""
        steps = self.settings.inner_steps if steps is None else steps
        losses = self.round_train_losses if continues else []
        for replica in self.replicas:
            losses.extend(replica.train(steps))
        self.exchange.compute(steps)
        self.round_train_losses = losses

    @abstractmethod
    def run_round(self, round_index: int) -> None:
        """Train one round and exchange; afterwards every replica's θ is what it evaluates."""

    def finish(self, rounds: int) -> None:
        """After the last of `rounds` rounds: settle what is still owed (nothing, by default)."""

    def replica_weights(self) -> list[NamedTensors]:
        """Each replica's θ after the round (= its φ where the protocol keeps one)."""
        return [replica.weights() for replica in self.replicas]

    @property
    def names(self) -> list[str]:
        return [replica.name for replica in self.replicas]
