"""NoLoCo over the simulated swarm: the in-memory side of each replica's NoLoCoRound.

Each replica's NoLoCoRound (node/rounds/noloco/round.py, the daemon's own) talks to a
`NoLoCoMemoryLink`, the in-memory NoLoCoLink; the links share one `NoLoCoMemoryNetwork`:
- at the end of round r every replica offers its snapshot S_r (`finish_round`) and meets the
  others there (node/simulator/lockstep.py); the network then pairs the replicas that offered
  (protocol/matching.py match_round over an instant, lossless control transport: every replica
  runs its MatchingState, as the daemon does) and each pair swaps its snapshots through the
  exchange (node/simulator/exchange.py), with its latency and losses;
- overlap: those snapshots travel during round r+1; a replica's round takes its partner's at the
  first step boundary after it arrives (`partner_landed`, `take_partner`: the round's mid-round
  correction), or at the end of round r+1; one that has not arrived by then is late (no
  correction). With no latency it arrives before round r+1's first step, and overlap computes
  what blocking does, without its wait;
- blocking: every replica waits until its partner's S_r arrives, at most the deadline (the
  simulated clock advances for all: idle); one not arrived by then is late: a local update.
A lost snapshot means a local update for its receiver only; its sender still paid the bytes.
A refused snapshot strikes its sender, and `ban_after` strikes ban it as the daemon does: the
banning replica's matching leaves it out (never proposes to it, declines its proposals), for the
rest of the run (the daemon's ban lasts contributions.ban_seconds; the simulator has no seconds).
Replicas run in lockstep, so none ever falls behind its swarm (`catch_up_round` is None).
"""

from __future__ import annotations

import random
from collections import Counter

from node.rounds.noloco.round import PartnerSnapshot
from node.simulator.exchange import InMemoryExchange, InMemoryMessage
from node.simulator.lockstep import Lockstep
from protocol.matching import MatchingState, ReadyAnnouncement, match_round

TOPIC = "noloco-snapshot"
MANIFEST = "simulation"  # every replica runs the same manifest


class NoLoCoMemoryNetwork:
    def __init__(self, names: list[str], exchange: InMemoryExchange, lockstep: Lockstep,
                 timing: str, max_staleness: int, seed: int, ban_after: int):
        self.exchange, self.lockstep, self.timing = exchange, lockstep, timing
        self.ban_after = ban_after
        self.strikes: Counter = Counter()  # (receiver, sender) -> refused contributions
        self.matching = {name: MatchingState(name, MANIFEST, 0, max_staleness,
                                             admitted=lambda peer, me=name: not self.banned(me, peer))
                         for name in names}
        self._pairing_rng = random.Random(seed)
        self._delivery_rng = random.Random(seed + 1)
        self.offers: dict[str, tuple[int, InMemoryMessage]] = {}  # name -> its latest snapshot
        self.pair_history: list[list[tuple[str, str]]] = []
        self.refused: Counter = Counter()  # contributions refused, by reason
        self.late = 0  # snapshots that arrived after their round ended

    def banned(self, receiver: str, sender: str) -> bool:
        return self.strikes[(receiver, sender)] >= self.ban_after

    def link(self, name: str) -> NoLoCoMemoryLink:
        return NoLoCoMemoryLink(self, name)

    def pair_and_swap(self, wait_s: float) -> None:
        """Pairs the replicas that offered a snapshot; each pair swaps them. A swap belongs to
        the round that uses it: the one just ended (blocking) or the next (overlap). Blocking:
        every replica waits for its partner's, at most `wait_s` steps."""
        ready = [ReadyAnnouncement(name, MANIFEST, round_index)
                 for name, (round_index, _) in sorted(self.offers.items())]
        states = {a.peer_id: self.matching[a.peer_id] for a in ready}
        for announcement in ready:  # the matching round is the round of the snapshot offered
            state = states[announcement.peer_id]
            if state.round_index != announcement.round_index:
                state.end_round(next_round=announcement.round_index)
        pairs = match_round(states, ready, self._pairing_rng, self._delivery_rng) if ready else {}
        used_in = None
        for name, pair in sorted(pairs.items()):
            if pair is not None:
                snapshot_round, message = self.offers[name]
                used_in = snapshot_round + (self.timing == "overlap")
                self.exchange.send(name, pair.partner, TOPIC, used_in, message, message.size_bytes)
        for state in states.values():
            state.end_round()
        self.pair_history.append(sorted({tuple(sorted((n, p.partner)))
                                         for n, p in pairs.items() if p is not None}))
        if self.timing == "blocking" and used_in is not None:
            self.exchange.wait(min(self.exchange.time_until_arrival(TOPIC, used_in), int(wait_s)))

    def round_ended(self, round_index: int) -> None:
        """After every replica ended `round_index`: swaps for it still in transit are late."""
        self.late += self.exchange.expire(TOPIC, up_to_round=round_index)

    def flush(self) -> None:
        """Training stopped: the snapshots swapped for the next round are waited for (overlap)."""
        self.exchange.wait(self.exchange.time_until_arrival(TOPIC))


class NoLoCoMemoryLink:
    """One replica's NoLoCoLink (node/rounds/noloco/round.py) over the in-memory network."""

    def __init__(self, network: NoLoCoMemoryNetwork, name: str):
        self.network, self.name = network, name

    def partner_landed(self) -> bool:
        return bool(self.network.exchange.arrived(self.name, TOPIC))

    def take_partner(self, round_index: int) -> PartnerSnapshot | None:
        return self._take(round_index)

    def pending_pair_rounds(self) -> set[int]:
        return set()  # lockstep: a swap not landed by its round's end is late (round_ended)

    def finish_round(self, round_index: int, snapshot: list, wait_s: float,
                     next_round: int | None = None) -> PartnerSnapshot | None:
        self.network.offers[self.name] = (round_index, InMemoryMessage(round_index, snapshot))
        self.network.lockstep.rendezvous(lambda: self.network.pair_and_swap(wait_s))
        return self._take(round_index) if self.network.timing == "blocking" else None

    def catch_up_round(self, round_index: int) -> int | None:
        return None  # lockstep: no replica falls behind

    def swarm_state(self, reference: dict, from_round: int) -> None:
        return None  # never asked: no replica falls behind

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        self.network.refused[reason] += 1
        self.network.strikes[(self.name, peer)] += 1

    def _take(self, round_index: int) -> PartnerSnapshot | None:
        arrived = self.network.exchange.collect(self.name, TOPIC, round_index)
        if not arrived:
            return None
        envelope = arrived[0]  # one pair a round
        return PartnerSnapshot(envelope.sender, envelope.payload.round, envelope.payload,
                               pair_round=round_index)
