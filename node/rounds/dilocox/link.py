"""What DiLoCoX's round (round.py, the training thread) and its exchange (exchange.py, the event
loop) hand each other: the interface the round calls, the messages and states it gets back.
The exchange's side imports nothing of the training side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# Steps a diverged node can replay from its last agreed state (round.py `_replayed`): a slow node learns
# of its split only when the others' votes reach it, 4 rounds late on 512 kbit/s. Members keep
# the messages (relay.py) and their records of each step (replay.py) as long.
REPLAY_ROUNDS = 8


@dataclass
class GroupMessage:
    peer: str
    round_index: int
    message: Any  # a received message holding a payload (payload.decode_message reads it)


@dataclass(frozen=True)
class SwarmState:
    """The swarm's state for a node that fell behind it (node/rounds/dilocox/catch_up.py)."""
    next_round: int   # the round to train next: the swarm's
    state_round: int  # the round whose φ and m these are
    # {"phi", "momentum"} downloaded and verified, or {"replay": recipe} (as `take_resync`'s)
    # that rebuilds them from our agreed state and is kept only if it gives `digest`
    state: dict
    source: str       # the member that served it
    digest: str | None  # of the swarm's φ of state_round


class DiLoCoXLink(Protocol):
    """The network's side, called from the training thread."""

    def send_round(self, round_index: int, tensors: list) -> None:
        """Sends this node's compressed message of the round to the group (in the background)."""

    def in_committee(self, round_index: int) -> bool:
        """Whether this node is drawn to send its message of `round_index` (protocol/committee.py:
        the manifest's `senders` and `senders_tenure`, and this link's view of the swarm's size;
        always without a committee). The same draw decides whose messages a round waits for."""

    def collect(self, round_index: int, wait_s: float) -> list[GroupMessage]:
        """The group's messages of `round_index` that arrived, waiting at most `wait_s`; nothing,
        at once, for a round already collected."""

    def behind(self, round_index: int) -> bool:
        """A majority of our members finished the round after `round_index` while we still train
        it: our message of it is due now."""

    def ran_ahead(self) -> float:
        """Of the last `collect`'s wait, the seconds spent on members still training its round:
        how far this node ran ahead of them."""

    def take_if_complete(self, round_index: int) -> list[GroupMessage] | None:
        """The messages of `round_index` if every one the link would wait for is here, taken as
        `collect` takes them; else None, at once."""

    def publish_digest(self, round_index: int, digest: str,
                       applied: tuple[int, tuple[str, ...]] | None = None) -> None:
        """Announces φ's digest after the round (the link compares it with the majority), and
        `applied`: (the round the step applied, the senders of every message it took), what a
        member whose φ left ours asks for to replay the step."""

    def take_resync(self, round_index: int) -> dict | None:
        """If our φ after `round_index` disagreed with the majority's: a majority peer's verified
        state ({"slow_weights", "momentum", "source"}), or what replays our steps since our last
        agreed round ({"replay": {"since", "round", "steps" [(round, the round it applied,
        senders)], "messages" {(applied round, author): received copy}, "digest"}}); else None."""

    def replay_failed(self, recipe: dict, start: int | None) -> None:
        """The replay `recipe` (as `take_resync`'s) did not give the majority's φ, or could not
        run: our records of its steps are not ours, and replays start from our agreed state of
        round `start` from now on (None: we hold none, and the next divergence downloads)."""

    def last_agreed(self) -> int:
        """The last round whose φ of ours the consensus check found the majority's (the round
        before this node's first: its starting state, before any was checked)."""

    def settle(self, round_index: int, wait_s: float) -> None:
        """Before the outer step of `round_index`: when our φ is known to be off the majority's,
        waits at most `wait_s` for the resync of the round before on its way; at once otherwise."""

    def catch_up(self, round_index: int, reference: dict) -> SwarmState | None:
        """The swarm's state when this node, ending `round_index`, fell too far behind its swarm
        and one was had; else None. `reference`: our φ, what the state is checked against."""

    def rejoin(self, from_round: int, state: SwarmState) -> None:
        """We adopted `state` instead of training `from_round`: the link takes part from the
        swarm's round on."""

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        """Counts a refused contribution against `peer` (and may ban it)."""

    def send_ratio(self) -> float | None:
        """Seconds the message just handed over will take to send, over one round's compute
        (0 for a link that models no bandwidth); None before the link has measured a send (the
        controller then holds its settings)."""

    def shared_ratio(self) -> float:
        """What the busiest receiver's downlink would take for every member's message of the
        size just handed over, over one round's compute: it holds the controller's moves up
        (protocol/controller.py r_s; 0 where it is not measured)."""
