"""Everything a node reports, one dataclass per event, and the bus that hands each to its subscribers.

Who reports what:
- the training thread (node/daemon/worker.py, node/train/standalone.py): StepDone, RoundEnded
  (carrying the round class's outcome, node/rounds/<protocol>/round.py), PairCorrected,
  Evaluated, Checkpointed, Stopping, Trained, Failed;
- the exchanges (node/rounds/<protocol>/exchange.py): Paired, Swapped, ... and Sent, Diverged, ...;
- the daemon (node/daemon/): Joined, WaitingForPeers, MinPeersTimeout, Started, Resumed,
  LateJoined, TransportSummary, Left;
- background tasks (node/loop.py): TaskFailed.
Who listens, each to what it needs (wired in node/daemon/daemon.py): the metrics log (every
event: `record()` is its JSON line in <data_dir>/metrics.jsonl), the status feed
(node/ops/status_feed.py), the φ announcement (node/daemon/members.py) and the log (events
marked `logged`).

Invariants: an event is a frozen record of what happened, stamped with the time it happened;
nothing is computed here. The JSON of every event is `{"event": kind, "time": ..., **fields}`,
the format tests, benchmarks and `local-swarm` read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from node.rounds.policy import RoundOutcome

log = logging.getLogger("lowcomm.events")


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str]
    logged: ClassVar[bool]  # one INFO line in the node's log
    time: float = field(default_factory=time.time, kw_only=True)

    def __init_subclass__(cls, kind: str = "", logged: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind, cls.logged = kind, logged

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "time"}

    def record(self) -> dict[str, Any]:
        """The event as one JSON object (metrics.jsonl)."""
        return {"event": self.kind, "time": self.time, **self.fields()}


Handler = Callable[[Event], None]


class EventBus:
    """Hands each published event to the subscribers of its type, in subscription order.

    `publish` runs them on the caller's thread: the daemon publishes on its event loop only
    (the training thread posts through node/loop.py LoopBridge). A subscriber that raises is
    logged and counted; the reporter and the other subscribers go on.
    """

    def __init__(self) -> None:
        self._handlers: list[tuple[tuple[type[Event], ...], Handler]] = []
        self.failures: Counter = Counter()

    def subscribe(self, handler: Handler, *kinds: type[Event]) -> None:
        """`handler` gets every event of the given types (all events when none is given)."""
        self._handlers.append((kinds or (Event,), handler))

    def publish(self, event: Event) -> None:
        for kinds, handler in self._handlers:
            if isinstance(event, kinds):
                try:
                    handler(event)
                except Exception as exc:  # a broken view must not stop training or the others
                    name = getattr(handler, "__qualname__", repr(handler))
                    self.failures[name] += 1
                    log.error("the %s subscriber %s failed on a %s event: %s: %s", self.failures[name],
                              name, event.kind, type(exc).__name__, exc)


def log_event(event: Event) -> None:
    """The log subscriber: one line for the events an operator follows."""
    if event.logged:
        log.info("%s %s", event.kind, {k: v for k, v in event.fields().items() if k != "energy_kept"})


# ---------------------------------------------------------------------- the training thread
@dataclass(frozen=True)
class StepDone(Event, kind="step"):
    step: int
    round: int | None  # None: a node alone (`lowcomm-node train`)
    loss: float
    lr: float
    grad_norm: float
    tokens_per_second: float


@dataclass(frozen=True)
class RoundEnded(Event, kind="round", logged=True):
    round: int
    step: int
    round_seconds: float   # the round's inner steps (and what ran between them, below)
    outer_seconds: float   # its end: the outer step, and any wait on the network
    outcome: RoundOutcome  # the protocol's report: node/rounds/<protocol>/round.py
    peers_alive: int
    val_loss: float | None = None  # None: not evaluated this round
    perplexity: float | None = None
    # the protocol's work at the round's step boundaries (a partner's snapshot applied, a
    # mid-round outer step): time the trainer did not train, apart from the round's end
    between_steps_seconds: float = 0.0

    def fields(self) -> dict[str, Any]:
        fields = {k: v for k, v in super().fields().items() if k != "outcome"}
        for unmeasured in ("val_loss", "perplexity"):
            if fields[unmeasured] is None:
                del fields[unmeasured]
        return {**fields, **dataclasses.asdict(self.outcome)}


@dataclass(frozen=True)
class PairCorrected(Event, kind="pair_correction"):
    """NoLoCo overlap: a partner's snapshot corrected φ, δ and θ in the middle of a round."""

    round: int          # the round whose φ changed (the last one ended)
    phi_digest: str     # φ after the correction
    partner: str
    phi_before: str     # φ before it: the correction changed φ when the two differ
    shift: float        # the norm of what the correction added to θ
    seconds: float = 0.0       # how long it held the training thread, in all
    wait_seconds: float = 0.0  # of which waiting on the event loop for the snapshot
    decode_seconds: float = 0.0  # decoding it from the wire onto the training device
    check_seconds: float = 0.0   # the contribution checks (node/rounds/contributions.py)
    digest_seconds: float = 0.0  # φ's new digest (protocol/tensors.py weights_digest)


@dataclass(frozen=True)
class DeviceUse(Event, kind="device_use", logged=True):
    """How the trainer uses its device (node/train/accelerator.py): at the start, and again
    when it changes (a compilation that fell back to eager, a micro-batch halved)."""

    precision: str     # "bf16: compute capability 9.0 has bf16 units (>= 8.0)"
    compute: str       # "compiled (train.compile = auto)" or "eager (<why>)"
    micro_batch: int   # sequences per forward and backward


@dataclass(frozen=True)
class Evaluated(Event, kind="eval"):
    step: int
    val_loss: float
    perplexity: float


@dataclass(frozen=True)
class Checkpointed(Event, kind="checkpoint"):
    step: int
    path: str


@dataclass(frozen=True)
class CheckpointSkipped(Event, kind="checkpoint_skipped"):
    reason: str


@dataclass(frozen=True)
class Stopping(Event, kind="stopping", logged=True):
    signal: str | None = None  # what asked (a signal, a preemption notice); None: the thread
    step: int | None = None    # the step the training thread stopped after


@dataclass(frozen=True)
class Trained(Event, kind="trained"):
    step: int
    tokens: int
    compute_seconds: float


@dataclass(frozen=True)
class Failed(Event, kind="failed", logged=True):
    error: str


@dataclass(frozen=True)
class TrainingStarted(Event, kind="start"):
    """`lowcomm-node train`: what the lone node trains, and where it starts."""

    corpus: str
    corpus_digest: str
    device: str
    parameters: int
    threads: int
    step: int
    steps: int
    resumed_from: str | None


@dataclass(frozen=True)
class TrainingDone(Event, kind="done"):
    step: int
    val_loss: float
    tokens_per_second: float


# ---------------------------------------------------------------------- the daemon's life
@dataclass(frozen=True)
class Joined(Event, kind="joined", logged=True):
    peer_id: str
    addresses: list[str]
    manifest: str
    corpus_digest: str


@dataclass(frozen=True)
class ReachabilityFound(Event, kind="reachability", logged=True):
    """Whether others can dial this node (p2p/reachability.py): public, private (behind NAT,
    reachable through `relay_addrs`) or local (loopback only)."""

    mode: str
    how: str
    relay_addrs: list[str]
    line: str


@dataclass(frozen=True)
class Resumed(Event, kind="resumed", logged=True):
    checkpoint: str
    step: int


@dataclass(frozen=True)
class LateJoined(Event, kind="late_join", logged=True):
    source: str
    round: int
    state_round: int | None
    digest: str | None
    bytes_fetched: int = 0         # the state's bytes asked of its servers, in all
    state_bytes: int = 0           # one state's bytes
    sources: tuple[str, ...] = ()  # the members that served its ranges, in order
    download_s: float = 0.0        # from the first question to a member to the state verified


@dataclass(frozen=True)
class CaughtUp(Event, kind="caught_up", logged=True):
    """This node fell too far behind its swarm and adopted the swarm's state mid-run: DiLoCoX,
    its messages no longer counting, replayed or downloaded (node/rounds/dilocox/catch_up.py);
    NoLoCo, on its first jump to the swarm's round (node/rounds/noloco/round.py)."""
    source: str
    from_round: int        # the round this node would have trained next
    round: int             # the round it trains next instead
    state_round: int | None
    digest: str | None
    by: str = "download"   # or "replay": the swarm's steps replayed from our agreed state


@dataclass(frozen=True)
class RoundShortened(Event, kind="round_shortened", logged=True):
    """DiLoCoX: a majority of this node's members finished the round after the one it trains,
    so it ends this round at its next step (node/rounds/dilocox/round.py between_steps)."""
    round: int
    skipped_steps: int     # the round's inner steps left untrained


@dataclass(frozen=True)
class WaitingForPeers(Event, kind="waiting_for_peers", logged=True):
    """Before round 0 (--min-peers): the members seen, each time their numbers change. Only
    eligible ones count (node/daemon/members.py eligible): a banned member, one on another
    manifest or one the newcomer gate holds back is seen but never counted."""
    wanted: int
    eligible: int
    alive: int   # live records in the member cache, eligible or not
    known: int   # records in the member cache


@dataclass(frozen=True)
class MinPeersTimeout(Event, kind="min_peers_timeout", logged=True):
    wanted: int
    found: int


@dataclass(frozen=True)
class Started(Event, kind="started"):
    round: int
    step: int


@dataclass(frozen=True)
class TransportSummary(Event, kind="transport"):
    """At leaving: the transport's counters, the proof that every message was signed and verified."""

    counters: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        return dict(self.counters)


@dataclass(frozen=True)
class Left(Event, kind="left", logged=True):
    pass


@dataclass(frozen=True)
class TaskFailed(Event, kind="task_failed"):
    task: str
    error: str


# ---------------------------------------------------------------------- NoLoCo's exchange
@dataclass(frozen=True)
class Paired(Event, kind="paired"):
    round: int
    partner: str


@dataclass(frozen=True)
class PairCancelled(Event, kind="pair_cancelled"):
    round: int
    partner: str
    why: str


@dataclass(frozen=True)
class Swapped(Event, kind="swapped"):
    round: int
    partner: str
    partner_round: int
    bytes: int  # the partner's snapshot as received


@dataclass(frozen=True)
class SwapFailed(Event, kind="swap_failed", logged=True):
    round: int
    partner: str
    error: str


@dataclass(frozen=True)
class SwapLate(Event, kind="swap_late"):
    round: int
    partner: str


@dataclass(frozen=True)
class PairingPaced(Event, kind="pairing_paced", logged=True):
    """How often this node pairs changed (node/rounds/noloco/pacing.py): once every `interval`
    rounds, from its swaps' and rounds' measured seconds (medians of the last few)."""
    round: int
    interval: int
    swap_seconds: float
    round_seconds: float


@dataclass(frozen=True)
class LinkJudged(Event, kind="link_judged", logged=True):
    """Whether this node's link, as its exchanges measured it, carries the swarm's rounds as
    configured (node/rounds/link_watch.py), when that changed: `level` "ok", "slower" (the
    protocol saves bytes: NoLoCo pairs less often, DiLoCoX's controller compresses harder) or
    "too_slow" (not even then); `text` says so in one sentence, with the numbers."""
    round: int
    level: str
    measured_mbit: float
    round_seconds: float
    text: str


@dataclass(frozen=True)
class Rested(Event, kind="rested"):
    """This round the node does not pair: its swaps take longer than its rounds."""
    round: int
    interval: int


@dataclass(frozen=True)
class NoPartner(Event, kind="no_partner", logged=True):
    round: int
    waited_s: float


# ---------------------------------------------------------------------- DiLoCoX's exchange
@dataclass(frozen=True)
class Sent(Event, kind="sent"):
    round: int
    group: list[str]
    bytes: int  # one copy of the message


@dataclass(frozen=True)
class SendFailed(Event, kind="send_failed", logged=True):
    round: int
    peer: str
    error: str


@dataclass(frozen=True)
class Missing(Event, kind="missing"):
    round: int
    peers: list[str]


@dataclass(frozen=True)
class Equivocated(Event, kind="equivocated", logged=True):
    """DiLoCoX: `author` signed two versions of its message of `round` (the proof came to us or
    was made here): banned, its messages dropped (node/rounds/dilocox/evidence.py)."""
    round: int
    author: str


@dataclass(frozen=True)
class Stored(Event, kind="stored"):
    """DiLoCoX, at each collect: the relay store's payload bytes and the furthest round it
    holds a message of (node/rounds/dilocox/relay.py, bounds.py)."""
    round: int
    bytes: int
    furthest_round: int


@dataclass(frozen=True)
class Relayed(Event, kind="relayed"):
    """DiLoCoX: the message of `author` for `round`, which had not come, fetched from `holder`
    and checked against the author's signature (node/rounds/dilocox/relay.py)."""
    round: int
    author: str
    holder: str
    bytes: int


@dataclass(frozen=True)
class Diverged(Event, kind="diverged", logged=True):
    round: int
    ours: str
    majority: str
    votes: dict[str, int]


@dataclass(frozen=True)
class ResyncReady(Event, kind="resync_ready", logged=True):
    round: int
    source: str


@dataclass(frozen=True)
class ReplayReady(Event, kind="replay_ready", logged=True):
    """DiLoCoX: our φ of `round` left the majority's; `source`'s records of its last `steps`
    steps (their `senders` messages in all), and the `fetched` ones we lacked (`bytes`), are
    here to replay them (node/rounds/dilocox/replay.py) instead of downloading the state."""
    round: int
    source: str
    steps: int
    senders: int
    fetched: int
    bytes: int
