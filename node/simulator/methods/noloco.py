"""NoLoCo over the simulated swarm (PROTOCOLS.md §1): random pairs, snapshot swaps, outer steps.

Each replica runs the daemon's pieces: a protocol.noloco.NoLoCo (φ, δ), a
protocol.matching.MatchingState, and the snapshot codec (bf16 by default) for what it sends.
The matching's control messages travel instantly and losslessly (protocol.matching.match_round);
snapshots travel through the exchange, with its latency and losses.

Timing, as PROTOCOLS.md defines it:
- overlap: each round ends with the local update (G = {i}); at the start of round r the
  replicas pair up and swap their round-(r−1) snapshots, which travel while round r computes;
  at the first step boundary after they arrive each applies that pair's update late, as a
  correction of φ, δ and θ (NoLoCo.late_pair_correction). With no latency that is before the
  round's first step, and overlap computes exactly what blocking does, without its wait. A
  snapshot that has not arrived by the round's end (latency > H) is late: no correction. Round
  0 has no earlier snapshot anywhere.
- blocking: after round r the replicas pair up and swap round r's snapshots, and wait for them
  up to `deadline_steps` (idle time); one not arrived by the deadline is late: a local update.
A lost snapshot also means a local update for its receiver only; its sender still pays the bytes.
"""

from __future__ import annotations

import random

from node.simulator.methods.base import Method
from protocol.codecs import Encoded, get_codec
from protocol.matching import MatchingState, ReadyAnnouncement, match_round
from protocol.noloco import NoLoCo, NoLoCoHyperParameters, NoLoCoSnapshot
from protocol.tensors import NamedTensors, shift_in_place

TOPIC = "noloco-snapshot"
MANIFEST = "simulation"  # every replica runs the same manifest


class NoLoCoSwarm(Method):
    def __init__(self, settings, replicas, exchange) -> None:
        super().__init__(settings, replicas, exchange)
        hyper = NoLoCoHyperParameters(settings.noloco_momentum, settings.noloco_progress_weight,
                                      settings.noloco_consensus_weight)
        self.outer = {r.name: NoLoCo(r.trainer.named_parameters(), hyper) for r in replicas}
        self.matching = {r.name: MatchingState(r.name, MANIFEST, 0, settings.max_staleness)
                         for r in replicas}
        self.codec = get_codec(settings.snapshot_codec)
        self.shapes = {name: t.shape for name, t in replicas[0].trainer.named_parameters().items()}
        self._pairing_rng = random.Random(settings.seed)
        self._delivery_rng = random.Random(settings.seed + 1)
        self.published: dict[str, tuple[int, dict[str, dict[str, Encoded]], int]] = {}
        self.pair_history: list[list[tuple[str, str]]] = []
        self.previous: dict[str, NoLoCoSnapshot] = {}  # overlap: own snapshot of the last round

    def run_round(self, round_index: int) -> None:
        if self.settings.timing == "overlap":
            self._overlap_round(round_index)
        else:
            self._blocking_round(round_index)
        self.counters.late_messages += self.exchange.expire(TOPIC)

    def _overlap_round(self, round_index: int) -> None:
        """Round r−1's snapshots travel during round r; each pair's update is applied as a
        correction at the first step boundary after they arrive; round r ends locally."""
        steps = self.settings.inner_steps
        arrival = min(self.exchange.time_until_arrival(TOPIC), steps) if self._pair_and_swap() \
            else steps
        self.inner_phase(arrival)
        self._late_pair_corrections()
        self.inner_phase(steps - arrival, continues=True)
        own = self._snapshots()
        for replica in self.replicas:
            replica.load(self.outer[replica.name].outer_step(own[replica.name]))
        self._publish(own, round_index)
        self.previous = own

    def _blocking_round(self, round_index: int) -> None:
        """Round r's snapshots are swapped after it, waited for up to the deadline."""
        self.inner_phase()
        own = self._snapshots()
        self._publish(own, round_index)
        if self._pair_and_swap():
            self.exchange.wait(min(self.exchange.time_until_arrival(TOPIC),
                                   self.settings.deadline_steps))
        self._outer_steps(own)

    def finish(self, rounds: int) -> None:
        """Overlap: the pairs of the last round have not swapped yet when training stops: pair,
        swap and apply those corrections (no training), so that the final weights hold every
        round's pair update, as blocking's do (DiLoCoX's `finish` does the same)."""
        if self.settings.timing == "overlap":
            if self._pair_and_swap():
                self.exchange.wait(self.exchange.time_until_arrival(TOPIC))
            self._late_pair_corrections()
            self.counters.late_messages += self.exchange.expire(TOPIC)

    # ------------------------------------------------------------------ pieces
    def _snapshots(self) -> dict[str, NoLoCoSnapshot]:
        return {r.name: self.outer[r.name].snapshot(r.trainer.named_parameters()) for r in self.replicas}

    def _publish(self, snapshots: dict[str, NoLoCoSnapshot], round_index: int) -> None:
        """Encode each replica's snapshot once; it is what the replica sends when it pairs."""
        for name, snapshot in snapshots.items():
            encoded = {part: {n: self.codec.encode(t, n) for n, t in tensors.items()}
                       for part, tensors in (("slow", snapshot.slow_weights),
                                             ("progress", snapshot.local_progress))}
            size = sum(e.size_bytes for part in encoded.values() for e in part.values())
            self.published[name] = (round_index, encoded, size)

    def _pair_and_swap(self) -> int:
        """Match the replicas that have published a snapshot; each pair swaps its snapshots.
        Returns the number of snapshots sent."""
        ready = [ReadyAnnouncement(name, MANIFEST, round_index)
                 for name, (round_index, _, _) in sorted(self.published.items())]
        states = {a.peer_id: self.matching[a.peer_id] for a in ready}
        for announcement in ready:  # the matching round is the round of the snapshot offered
            state = states[announcement.peer_id]
            if state.round_index != announcement.round_index:
                state.end_round(next_round=announcement.round_index)
        pairs = match_round(states, ready, self._pairing_rng, self._delivery_rng) if ready else {}
        sent = 0
        for name, pair in sorted(pairs.items()):
            if pair is None:
                continue
            round_index, encoded, size = self.published[name]
            self.exchange.send(name, pair.partner, TOPIC, round_index, encoded, size)
            sent += 1
        for state in states.values():
            state.end_round()
        self.counters.pairs_last_round = sorted({tuple(sorted((n, p.partner)))
                                                 for n, p in pairs.items() if p is not None})
        self.pair_history.append(self.counters.pairs_last_round)
        return sent

    def _outer_steps(self, own: dict[str, NoLoCoSnapshot]) -> None:
        for replica in self.replicas:
            arrived = self.exchange.collect(replica.name, TOPIC)
            partners = [self._decode(envelope.payload) for envelope in arrived]
            if not partners:
                self.counters.local_updates += 1
            replica.load(self.outer[replica.name].outer_step(own[replica.name], partners))

    def _late_pair_corrections(self) -> None:
        """Overlap: the partner snapshots of round r−1 that arrived during round r correct φ, δ
        and θ as if that pair's update had been taken in time (NoLoCo.late_pair_correction)."""
        for replica in self.replicas:
            partners = [self._decode(e.payload) for e in self.exchange.collect(replica.name, TOPIC)]
            if not partners:
                self.counters.local_updates += 1
                continue
            correction = self.outer[replica.name].late_pair_correction(self.previous[replica.name],
                                                                       partners)
            shift_in_place(replica.trainer.named_parameters(), correction)

    def _decode(self, encoded: dict[str, dict[str, Encoded]]) -> NoLoCoSnapshot:
        def tensors(part: str) -> NamedTensors:
            return {name: self.codec.decode(e.description, e.payload,
                                            max_elements=max(self.shapes[name].numel(), 1))
                    for name, e in encoded[part].items()}
        return NoLoCoSnapshot(tensors("slow"), tensors("progress"))
