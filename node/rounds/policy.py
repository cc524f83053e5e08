"""What the training loop asks of a protocol's round (NoLoCoRound, DiLoCoXRound), and what a round
reports when it ends.

Both drivers call a round the same way: the daemon's training thread (node/daemon/worker.py)
and the simulator (node/simulator/methods/rounds.py):

    for each round r:
        for each of its H inner steps:  event = policy.between_steps(r); trainer.train_step()
        outcome = policy.end_round(r)          # the outer step; θ is the next round's start

A round reaches the network only through its link (NoLoCoLink, DiLoCoXLink): the daemon's
exchanges over p2p, or the simulator's in-memory links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from node.events import Event


@dataclass(frozen=True)
class RoundOutcome:
    """What every protocol's round reports; the protocols add their own fields."""

    phi_digest: str               # φ after the round: what late joiners and the consensus check read
    refused: list[str]            # one sentence per contribution refused this round
    network_wait_seconds: float   # how long the training thread waited on the network

    @property
    def partners(self) -> list[str]:
        """The peers whose contributions this round applied."""
        raise NotImplementedError


class RoundPolicy(Protocol):
    """The protocol-specific part of a round, run in the training thread."""

    def between_steps(self, round_index: int) -> Event | None:
        """Called before every inner step of round `round_index` (must be cheap); returns an
        event to report, if any."""

    def end_round(self, round_index: int) -> RoundOutcome:
        """Applies the outer step and leaves θ where the next round starts."""

    # DiLoCoXRound also has end_round_beside(round_index, θ on the host) -> (outcome, shift of
    # θ, the swarm's round if caught up): the same round's end in a thread beside training
    # (node/daemon/worker.py), touching no trainer state; its outcome's `ran_ahead_seconds`
    # holds training as long as the round's end waited for members behind.

    def export_state(self, round_index: int | None = None) -> tuple[int, dict, str]:
        """(round, {"phi": φ, "momentum": ...}, digest of φ) for a late joiner; any thread."""

    def state_version(self, round_index: int | None = None) -> tuple[int, str]:
        """(round, digest of φ) of what `export_state(round_index)` would give, without copying
        anything: the state server's key for its shared export; any thread."""

    def adopt(self, groups: dict, state_round: int | None = None) -> None:
        """A late joiner takes the state another member exported (after `state_round`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
