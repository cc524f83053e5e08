"""DiLoCoX over the simulated swarm: the in-memory side of each replica's DiLoCoXRound.

Each replica's DiLoCoXRound (node/rounds/dilocox/round.py, the daemon's own) talks to a
`DiLoCoXMemoryLink`, the in-memory DiLoCoXLink; the links share one `DiLoCoXMemoryNetwork`:
- `send_round` hands over the replica's message of round r; when every replica has (they meet
  in `collect`, node/simulator/lockstep.py), each message goes to every other replica through
  the exchange, with its latency and losses: the group is the whole simulated swarm (the
  daemon's fan-out cap is not modelled);
- `collect` of round r − delay waits, as the daemon's does for members that finished the round,
  until those messages arrive, at most the deadline (the simulated clock advances for all:
  idle); with delay 1 they travelled during round r and rarely make anyone wait. One still in
  flight after that is late: never applied;
- consistency, as the daemon's exchange arranges it: after each round the network compares the
  replicas' φ digests (16 bytes to each other replica); a replica whose digest differs from the
  most common one (ties: the smallest digest) takes φ and m of the first replica holding it,
  served by that replica's round (`export_state`, fp32, counted to it), and adopts them before
  its next outer step (`resync`). Without losses all digests agree.
Bytes: each message counts its encoded size once per recipient (N−1 copies: a compressed
message cannot be summed on the way as a ring all-reduce sums fp32). With a committee
(`senders`, protocol/committee.py) only the round's committee sends.
"""

from __future__ import annotations

from collections import Counter

from node.rounds.dilocox.link import (Agreement, Collected, Download, GroupMessage, Refused, Report,
                                      SendCosts, Stepped)
from node.rounds.dilocox.round import DiLoCoXRound
from node.simulator.exchange import InMemoryExchange, InMemoryMessage
from node.simulator.lockstep import Lockstep
from protocol.committee import send_share, sends
from protocol.tensors import fp32_clone, numel
from protocol.vote import winning_digest

TOPIC = "dilocox-pseudo-gradient"
DIGEST_BYTES = 16  # protocol.tensors.weights_digest: BLAKE3, 128 bits
FP32_BYTES = 4


class DiLoCoXMemoryNetwork:
    def __init__(self, names: list[str], exchange: InMemoryExchange, lockstep: Lockstep,
                 delay: int, senders: int = 0, tenure: int = 1):
        self.names, self.exchange, self.lockstep, self.delay = names, exchange, lockstep, delay
        # the committee's (protocol/committee.py)
        self.share, self.tenure = send_share(senders, len(names)), tenure
        self.sent: dict[int, set[str]] = {}  # round -> the replicas that sent its message
        self.distinct_digests = 0  # of φ at the last round's end: 1 when every replica agrees
        self.rounds: dict[str, DiLoCoXRound] = {}  # who serves a resync: each replica's round
        self.outbox: dict[str, InMemoryMessage] = {}  # this round's messages, not sent yet
        self.digests: dict[str, str] = {}  # this round's φ digests
        self.resyncs: dict[tuple[str, int], Download] = {}  # (replica, round) -> the majority's state
        self.refused: Counter = Counter()  # contributions refused, by reason
        self.late = 0  # messages that arrived after their round was applied

    def link(self, name: str) -> DiLoCoXMemoryLink:
        return DiLoCoXMemoryLink(self, name)

    def send_and_wait(self, round_index: int, wait_s: float) -> None:
        """Every replica handed its message over: send them all, then wait (all replicas, at
        most `wait_s` steps) for the messages of `round_index` to arrive."""
        self._send()
        self.exchange.wait(min(self.exchange.time_until_arrival(TOPIC, round_index), int(wait_s)))

    def _send(self) -> None:
        for sender, message in sorted(self.outbox.items()):
            self.sent.setdefault(message.round, set()).add(sender)
            for recipient in self.names:
                if recipient != sender:
                    self.exchange.send(sender, recipient, TOPIC, message.round, message,
                                       message.size_bytes)
        self.outbox.clear()

    def round_ended(self, round_index: int, last: bool = False) -> None:
        """After every replica's outer step of `round_index`: messages not sent yet go (delay 1,
        round 0: nobody collected), late ones expire, digests are compared, and the replicas
        whose φ left the majority get its state for their next outer step (none after the
        `last`)."""
        self._send()
        self.late += self.exchange.expire(TOPIC, up_to_round=round_index - self.delay)
        self.sent = {r: s for r, s in self.sent.items() if r > round_index - self.delay}
        self.distinct_digests = len(set(self.digests.values()))
        for name in self.names:
            self.exchange.count_bytes(name, DIGEST_BYTES * (len(self.names) - 1))
        majority = winning_digest(Counter(self.digests.values()))
        provider = next(name for name in sorted(self.digests) if self.digests[name] == majority)
        for name, digest in sorted(self.digests.items()):
            if digest != majority and not last:
                held, groups, _ = self.rounds[provider].export_state(round_index)
                self.resyncs[(name, held)] = Download(held, fp32_clone(groups["phi"]),
                                                      fp32_clone(groups["momentum"]), provider)
                self.exchange.count_bytes(provider, 2 * numel(groups["phi"]) * FP32_BYTES)
        self.digests.clear()


class DiLoCoXMemoryLink:
    """One replica's DiLoCoXLink (node/rounds/dilocox/round.py) over the in-memory network.
    In lockstep no replica falls behind or runs ahead of another (`swarm_round` stays unknown,
    `ran_ahead_s` 0, no catch-up), and a replica that left the majority's φ takes the state
    whole (`round_ended`), never by replay."""

    swarm_round = -1

    def __init__(self, network: DiLoCoXMemoryNetwork, name: str):
        self.network, self.name = network, name

    def in_committee(self, round_index: int) -> bool:
        return sends(self.name, round_index, self.network.share, self.network.tenure)

    def send_round(self, round_index: int, tensors: list) -> None:
        self.network.outbox[self.name] = InMemoryMessage(round_index, tensors)

    def costs(self) -> SendCosts:
        """0: the in-memory exchange models latency, not bandwidth (the controller sees a free
        link from the first round on), and no receiver's downlink."""
        return SendCosts(0.0, 0.0)

    def collect(self, round_index: int, wait_s: float) -> Collected:
        self.network.lockstep.rendezvous(lambda: self.network.send_and_wait(round_index, wait_s))
        return Collected([GroupMessage(e.sender, round_index, e.payload)
                          for e in self.network.exchange.collect(self.name, TOPIC, round_index)])

    def take_if_complete(self, round_index: int) -> list[GroupMessage] | None:
        """The message of every other replica that sent one in `round_index` (all of them, or the
        round's committee) has arrived by this replica's step: taken now, without the rendezvous
        (the replicas train one after another, not together); the round's end still meets the
        others in `collect`, which then finds nothing new."""
        exchange = self.network.exchange
        expected = self.network.sent.get(round_index, set()) - {self.name}
        if not expected <= {e.sender for e in exchange.arrived(self.name, TOPIC, round_index)}:
            return None
        return [GroupMessage(e.sender, round_index, e.payload)
                for e in exchange.collect(self.name, TOPIC, round_index)]

    def resync(self, round_index: int, wait_s: float) -> Agreement:
        """Nothing to wait for: in lockstep a resync is ready before the next outer step."""
        return Agreement(-1, self.network.resyncs.pop((self.name, round_index - 1), None))

    def catch_up(self, round_index: int, reference: dict) -> None:
        return None

    def report(self, note: Report) -> None:
        if isinstance(note, Stepped):
            self.network.digests[self.name] = note.digest
        elif isinstance(note, Refused):
            self.network.refused[note.reason] += 1
        else:
            raise AssertionError(f"no replica replays or catches up: {note}")
