"""What DiLoCoX's round (round.py, the training thread) and its exchange (exchange.py, the event
loop) hand each other: the link's eight methods, one attribute the loop writes, and the typed
values that cross. The exchange's side imports nothing of the training side.

Contract between the threads:
- every value that crosses is a frozen dataclass or a plain number, replaced whole, never
  changed in place after it was handed over;
- the training thread never blocks on the loop between inner steps except for
  `take_if_complete` (which answers at once); whether it fell a round behind its swarm is read
  from `swarm_round`, which the loop refreshes as members announce their rounds (`is_behind`);
- `resync` is the only way an agreed state or a repair reaches the training thread, and
  `report` the only way the training thread tells the loop what its steps did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# Steps a diverged node can replay from its last agreed state (round.py `_replayed`): members
# keep the messages (relay.py) and their records of each step (replay.py) as long.
REPLAY_ROUNDS = 8
# Rounds behind the swarm's agreed round before a node takes the swarm's state. One round
# behind is left to the round's end (`is_behind`) and to the resync.
CATCH_UP_LAG = 2

# (our round, the round its step applied, the senders of the messages it applied)
Step = tuple[int, int, tuple[str, ...]]


def is_behind(round_index: int, swarm_round: int) -> bool:
    """Training `round_index`, a majority of our members already finished the round after it
    (they collect our message of `round_index` now): the round should end now. Not when they
    are CATCH_UP_LAG or more rounds ahead: the round's end then takes the swarm's state."""
    return 1 <= swarm_round - (round_index + 1) < CATCH_UP_LAG


@dataclass(frozen=True)
class GroupMessage:
    peer: str
    round_index: int
    message: Any  # a received message holding a payload (payload.decode_message reads it)


@dataclass(frozen=True)
class Collected:
    messages: list[GroupMessage]
    ran_ahead_s: float = 0.0  # of the wait, the seconds spent on members still training the round


@dataclass(frozen=True)
class SendCosts:
    """What the adaptive controller reads of the link (adapt.py, protocol/controller.py)."""
    # seconds the message just handed over will take to send, over one round's compute (0 for
    # a link that models no bandwidth; None before a send was measured: the controller holds)
    send_ratio: float | None
    # the busiest receiver's downlink for every member's message of that size, over one round
    shared_ratio: float = 0.0


@dataclass(frozen=True)
class Replay:
    """What rebuilds the majority's φ and m after `round` from our agreed state of `since`:
    each step's senders, the copies of their messages we lacked (by (applied round, author)),
    kept only if the result's digest is `digest`."""
    since: int
    round: int
    steps: list[Step]
    messages: dict[tuple[int, str], Any]
    digest: str
    source: str = ""


@dataclass(frozen=True)
class Download:
    """The majority's φ and m after `round`, downloaded whole from `source` and its digest
    verified by the loop; the training thread checks it as a contribution before adopting it."""
    round: int
    phi: dict
    momentum: dict
    source: str = "the majority"


@dataclass(frozen=True)
class Agreement:
    """The loop's word before an outer step: the last round whose φ of ours a check found the
    majority's (where a replay starts), and the repair due now, if any."""
    agreed: int
    resync: Replay | Download | None = None


@dataclass(frozen=True)
class SwarmState:
    """The swarm's state for a node that fell behind it (node/rounds/dilocox/catch_up.py)."""
    next_round: int   # the round to train next: the swarm's
    state_round: int  # the round whose φ and m these are
    state: Replay | Download  # kept only if a replay gives `digest`
    source: str       # the member that served it
    digest: str | None  # of the swarm's φ of state_round


# ---------------------------------------------------------------- what the training thread reports
@dataclass(frozen=True)
class Stepped:
    """The outer step of `round` gave φ with `digest`; `applied`: (the round whose messages it
    applied, their senders), None when it applied nothing we can vouch for."""
    round: int
    digest: str
    applied: tuple[int, tuple[str, ...]] | None = None


@dataclass(frozen=True)
class ReplayFailed:
    """`replay` did not give the majority's φ or could not run: replays start from our agreed
    state of round `start` from now on (None: we hold none, the next divergence downloads)."""
    replay: Replay
    start: int | None


@dataclass(frozen=True)
class Rejoined:
    """We adopted `state` instead of training `from_round`: take part from its round on."""
    from_round: int
    state: SwarmState


@dataclass(frozen=True)
class Refused:
    """A contribution of `peer` refused: counted against it (and it may be banned)."""
    peer: str
    reason: str
    sentence: str


Report = Stepped | ReplayFailed | Rejoined | Refused


class DiLoCoXLink(Protocol):
    """The network's side, called from the training thread."""

    # the round a majority of our members reached, as the loop last saw it (-1: unknown)
    swarm_round: int

    def in_committee(self, round_index: int) -> bool:
        """Whether this node is drawn to send its message of `round_index` (protocol/committee.py;
        always without a committee). The same draw decides whose messages a round waits for."""

    def send_round(self, round_index: int, tensors: list) -> None:
        """Sends this node's compressed message of the round to the group (in the background)."""

    def costs(self) -> SendCosts:
        """The cost of the message just handed over, for the adaptive controller."""

    def collect(self, round_index: int, wait_s: float) -> Collected:
        """The group's messages of `round_index` that arrived, waiting at most `wait_s`; nothing,
        at once, for a round already collected."""

    def take_if_complete(self, round_index: int) -> list[GroupMessage] | None:
        """The messages of `round_index` if every one `collect` would wait for is here, taken as
        `collect` takes them; else None, at once."""

    def resync(self, round_index: int, wait_s: float) -> Agreement:
        """Before the outer step of `round_index`: our last agreed round and the repair of our
        φ after `round_index - 1` (or an earlier round) if it left the majority's. While our φ
        is known off, waits at most `wait_s` (and one of our rounds) for the check in flight."""

    def catch_up(self, round_index: int, reference: dict) -> SwarmState | None:
        """The swarm's state when this node, ending `round_index`, fell CATCH_UP_LAG or more
        rounds behind its swarm and one was had; else None. `reference`: our φ."""

    def report(self, note: Report) -> None:
        """What the training thread did: a step, a failed replay, a rejoin, a refusal."""
