"""Where the status view gets each number: the node's events, turned into its NodeStatus.

The daemon subscribes a StatusFeed to its event bus (node/events.py); the control socket, MQTT
telemetry and the terminal view all read the NodeStatus it keeps. Per field (node/ops/status.py):

    step, round, state=training, tokens_per_second, train_loss   StepDone (the last step)
    precision, compute, micro_batch                DeviceUse (at start, and when it changes)
    val_loss                                       RoundEnded, when the round was evaluated
    bytes_*_round, bytes_*_total, last_exchange_at  RoundEnded: the transport's byte counters
                                                   since the last round; an exchange when the
                                                   round applied a partner's or group's work
    partners, peers_alive                          RoundEnded (its outcome; the worker's count)
    peers_known                                    RoundEnded: the member cache's records
    peers_alive, peers_known before round 0        WaitingForPeers (the --min-peers wait)
    rounds_per_minute                              RoundEnded: rounds ended since Started, per
                                                   minute (counted: a node's round index
                                                   jumps when it moves to its swarm's round)
    refused["contribution"]                        RoundEnded: the outcome's refusals
    refused[<transport reason>]                    `transport_refusals`, called by the daemon's
                                                   watch loop with the transport's counters
                                                   (reply handlers' refusals included:
                                                   p2p/counters.py counted_reply) and the ban
                                                   list's `other_refusals` (FORGED_RECORD,
                                                   state_*, resync_digest)
    compression_ratio                              Swapped (NoLoCo: θ, or φ and Δ) or Sent
                                                   (DiLoCoX): fp32 bytes of the payload's
                                                   tensors over the bytes received (so a
                                                   quantized wire_dtype shows its real ratio:
                                                   int8 3.76x, int4 7.1x, bf16 2x)
    compression                                    RoundEnded: DiLoCoX's controller choice, if on
    checkpoint_at, checkpoint_step                 Checkpointed
    pair_interval                                  PairingPaced (NoLoCo: how often it pairs)
    state=stopping                                 Stopping
    reachability                                   ReachabilityFound (its one line)
    link                                           LinkJudged (its sentence; "" when "ok")
    streams_direct, streams_relayed,               `transport_paths`, from the daemon's watch loop
    streams_forwarded, forwarded_for_others
CPU, memory and device numbers come from the usage sampler (node/ops/usage.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from node.events import (Checkpointed, DeviceUse, EventBus, LinkJudged, PairingPaced, ReachabilityFound,
                         RoundEnded, Sent, Started, StepDone, Stopping, Swapped, WaitingForPeers)
from node.ops.status import NodeStatus


class StatusFeed:
    def __init__(self, status: NodeStatus, *, param_bytes: int, snapshot_sets: int,
                 traffic: Callable[[], tuple[int, int]], peers_known: Callable[[], int]):
        """`param_bytes`: the model's fp32 size; `snapshot_sets`: model-sized tensor sets in one
        NoLoCo snapshot (node/rounds/noloco/payload.py tensor_sets); `traffic`: the transport's
        (bytes sent, bytes received) so far; `peers_known`: members in the member cache."""
        self.status, self.param_bytes, self.snapshot_sets = status, param_bytes, snapshot_sets
        self.traffic, self.peers_known = traffic, peers_known
        self._started = time.monotonic()
        self._rounds_ended = 0
        self._bytes_mark = (0, 0)
        self._transport_refused: dict[str, int] = {}

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(self._step, StepDone)
        bus.subscribe(self._device_use, DeviceUse)
        bus.subscribe(self._round, RoundEnded)
        bus.subscribe(self._started_at, Started)
        bus.subscribe(self._payload, Swapped, Sent)
        bus.subscribe(self._checkpoint, Checkpointed)
        bus.subscribe(self._stopping, Stopping)
        bus.subscribe(self._paced, PairingPaced)
        bus.subscribe(self._reachability, ReachabilityFound)
        bus.subscribe(self._link, LinkJudged)
        bus.subscribe(self._waiting, WaitingForPeers)

    def _link(self, event: LinkJudged) -> None:
        self.status.update(link="" if event.level == "ok" else event.text)

    def _reachability(self, event: ReachabilityFound) -> None:
        self.status.update(reachability=event.line)

    def _waiting(self, event: WaitingForPeers) -> None:
        self.status.update(peers_alive=event.alive, peers_known=event.known)

    def transport_paths(self, direct: int, relayed: int, forwarded: int = 0, for_others: int = 0) -> None:
        """Streams opened over direct connections, through relays and forwarded by a member
        (p2p/paths.py), and those this node forwarded for others (p2p/forwarding.py)."""
        paths = dict(streams_direct=direct, streams_relayed=relayed, streams_forwarded=forwarded,
                     forwarded_for_others=for_others)
        if any(getattr(self.status, name) != value for name, value in paths.items()):
            self.status.update(**paths)

    def _device_use(self, event: DeviceUse) -> None:
        self.status.update(precision=event.precision, compute=event.compute,
                           micro_batch=event.micro_batch)

    def _step(self, event: StepDone) -> None:
        self.status.update(step=event.step, round=event.round, state="training",
                           tokens_per_second=event.tokens_per_second)
        self.status.record_train_loss(event.loss)

    def _started_at(self, event: Started) -> None:
        self._rounds_ended = 0

    def _round(self, event: RoundEnded) -> None:
        status, outcome = self.status, event.outcome
        if event.val_loss is not None:
            status.record_val_loss(event.val_loss)
        sent, received = self.traffic()
        status.record_round(sent=sent - self._bytes_mark[0], received=received - self._bytes_mark[1],
                            exchanged=bool(outcome.partners))
        self._bytes_mark = (sent, received)
        elapsed = time.monotonic() - self._started
        self._rounds_ended += 1
        status.update(partners=outcome.partners, peers_alive=event.peers_alive,
                      peers_known=self.peers_known(),
                      rounds_per_minute=self._rounds_ended * 60 / elapsed)
        if outcome.refused:
            status.count_refused("contribution", len(outcome.refused))
        choice = getattr(outcome, "compression", None)  # DiLoCoX with its controller on
        if choice:
            status.update(compression=f"{choice['codec']} {choice['summary']}")

    def _payload(self, event: Swapped | Sent) -> None:
        # fp32 size over wire size of one payload: NoLoCo's θ or (φ, Δ), DiLoCoX's coded Δ
        # (per payload, since a swap may finish after its round's bytes were counted)
        if event.bytes:
            copies = self.snapshot_sets if isinstance(event, Swapped) else 1
            self.status.update(compression_ratio=copies * self.param_bytes / event.bytes)

    def _checkpoint(self, event: Checkpointed) -> None:
        self.status.update(checkpoint_at=event.time, checkpoint_step=event.step)

    def _paced(self, event: PairingPaced) -> None:
        self.status.update(pair_interval=event.interval)

    def _stopping(self, event: Stopping) -> None:
        self.status.update(state="stopping")

    def transport_refusals(self, refused: dict[str, int]) -> None:
        """The transport's refusals by reason (its counters) and the ban list's others, shown
        beside the contributions'."""
        if refused != self._transport_refused:
            self.status.update(refused={**self.status.refused, **refused})
            self._transport_refused = dict(refused)
