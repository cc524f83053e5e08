"""The simulator's in-memory transport: simulated time, latency, message loss, exact byte counts.

Time is counted in inner steps (one step of one replica), shared by all replicas: the replicas
run in lockstep, so a round's compute advances the clock by H, and a blocking wait advances it
by the time waited (counted as idle). Within a round the replicas train one after another, each
at the clock of its own step (`at`). A point-to-point message sent at time t arrives at
t + latency; it is dropped with probability `drop_probability`, decided when it is sent (the
sender still paid its bytes: they went on the wire).

Byte accounting (what `bytes_sent` holds, per sender):
- point-to-point messages count the bytes of the payload the round classes encode
  (node/rounds/<protocol>/payload.py: what the daemon hands its transport). Wire headers and
  signatures (p2p/wire.py) are NOT included; neither are the matching's small control
  messages (propose/accept/decline), which the simulator does not send.
- collectives (data-parallel's gradient, DiLoCo's Δ) are a ring all-reduce of one flat fp32
  vector, counted chunk by chunk with `ring_allreduce_bytes`: about 2·(N−1)/N × its bytes each.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from p2p.messages import OutgoingTensor, ReceivedMessage


def ring_allreduce_bytes(num_elements: int, element_bytes: int, workers: int) -> list[int]:
    """Bytes each rank sends in a ring all-reduce (reduce-scatter, then all-gather).

    The vector is cut into `workers` chunks, the first `num_elements % workers` one element
    longer. In the reduce-scatter, rank i sends every chunk but (i+1) mod N; in the all-gather,
    every chunk but (i+2) mod N. So the mean over ranks is exactly 2·(N−1)/N × the vector's bytes.
    """
    if workers < 1 or num_elements < 0 or element_bytes < 1:
        raise ValueError(f"a ring all-reduce needs workers >= 1 and sizes >= 0, got workers="
                         f"{workers}, elements={num_elements}, element_bytes={element_bytes}.")
    if workers == 1:
        return [0]
    base, extra = divmod(num_elements, workers)
    chunk = [(base + (1 if c < extra else 0)) * element_bytes for c in range(workers)]
    total = num_elements * element_bytes
    return [2 * total - chunk[(i + 1) % workers] - chunk[(i + 2) % workers] for i in range(workers)]


class InMemoryMessage:
    """A received message as the round classes read it (p2p's ReceivedMessage's `round` and
    `tensor_views`), built from what a round handed its link: the tensors' bytes, copied once,
    as a transport would."""

    def __init__(self, round_index: int, tensors: list[OutgoingTensor]):
        self.round = round_index
        self.tensors = tuple(t.entry() for t in tensors)
        self.payload = memoryview(b"".join(t.byte_view() for t in tensors))

    @property
    def size_bytes(self) -> int:
        return len(self.payload)

    tensor_views = ReceivedMessage.tensor_views  # the transport's own views of the payload


@dataclass
class Envelope:
    """One message in transit."""

    sender: str
    recipient: str
    topic: str
    round_index: int
    payload: Any
    size_bytes: int
    arrives_at: int


@dataclass
class ExchangeCounters:
    messages_sent: int = 0
    messages_dropped: int = 0
    messages_delivered: int = 0
    dropped_by_topic: Counter = field(default_factory=Counter)


class InMemoryExchange:
    """Messages between named replicas, delivered by simulated time; see the module docstring."""

    def __init__(self, names: Iterable[str], latency_steps: int = 0, drop_probability: float = 0.0,
                 seed: int = 0) -> None:
        self.names = list(names)
        if len(set(self.names)) != len(self.names) or not self.names:
            raise ValueError("the exchange needs at least one replica name, each used once.")
        if type(latency_steps) is not int or latency_steps < 0:
            raise ValueError(f"latency must be a whole number of inner steps >= 0, got {latency_steps!r}.")
        if not 0.0 <= drop_probability < 1.0:
            raise ValueError(f"drop probability must be in [0, 1), got {drop_probability!r}.")
        self.latency_steps, self.drop_probability = latency_steps, drop_probability
        self._drop_rng = random.Random(seed)
        self.now = 0
        self.idle_steps = 0
        self.bytes_sent = {name: 0 for name in self.names}
        self.counters = ExchangeCounters()
        self._in_transit: list[Envelope] = []

    # ------------------------------------------------------------------ time
    def compute(self, steps: int) -> None:
        """Every replica ran `steps` inner steps."""
        self.now += steps

    def wait(self, steps: int) -> None:
        """Every replica waited `steps` for the network: simulated time that trains nothing."""
        self.now += steps
        self.idle_steps += steps

    def at(self, time: int) -> None:
        """The clock of one replica's step within the current round (replicas train one after
        another; each sees what has arrived by its own step)."""
        self.now = time

    # ------------------------------------------------------------------ point to point
    def send(self, sender: str, recipient: str, topic: str, round_index: int, payload: Any,
             size_bytes: int) -> bool:
        """Put a message on the wire; False if it was lost (the bytes are counted either way)."""
        if sender not in self.bytes_sent or recipient not in self.bytes_sent or sender == recipient:
            raise ValueError(f"cannot send from {sender!r} to {recipient!r}: both must be "
                             "distinct replicas of this exchange.")
        self.bytes_sent[sender] += size_bytes
        self.counters.messages_sent += 1
        if self.drop_probability and self._drop_rng.random() < self.drop_probability:
            self.counters.messages_dropped += 1
            self.counters.dropped_by_topic[topic] += 1
            return False
        self._in_transit.append(Envelope(sender, recipient, topic, round_index, payload,
                                         size_bytes, self.now + self.latency_steps))
        return True

    def arrived(self, recipient: str, topic: str, round_index: int | None = None) -> list[Envelope]:
        """Messages for `recipient` on `topic` (of `round_index`, if given) that have arrived by
        now, in sending order; they stay in the exchange."""
        return [e for e in self._in_transit
                if e.recipient == recipient and e.topic == topic and e.arrives_at <= self.now
                and (round_index is None or e.round_index == round_index)]

    def collect(self, recipient: str, topic: str, round_index: int | None = None) -> list[Envelope]:
        """The same, taken out of the exchange (delivered)."""
        arrived = self.arrived(recipient, topic, round_index)
        if arrived:
            taken = {id(e) for e in arrived}
            self._in_transit = [e for e in self._in_transit if id(e) not in taken]
            self.counters.messages_delivered += len(arrived)
        return arrived

    def expire(self, topic: str, up_to_round: int | None = None) -> int:
        """Drop every message on `topic` (of rounds up to `up_to_round`, if given) still in
        transit: it would arrive after its use. Returns how many, for the caller to count as late."""
        def late(e: Envelope) -> bool:
            return e.topic == topic and (up_to_round is None or e.round_index <= up_to_round)
        expired = [e for e in self._in_transit if late(e)]
        self._in_transit = [e for e in self._in_transit if not late(e)]
        return len(expired)

    def in_transit(self, topic: str | None = None) -> int:
        return sum(1 for e in self._in_transit if topic is None or e.topic == topic)

    def time_until_arrival(self, topic: str, round_index: int | None = None) -> int:
        """How long until every message now in transit on `topic` (of `round_index`, if given)
        has arrived (0 if none)."""
        pending = [e.arrives_at for e in self._in_transit if e.topic == topic
                   and (round_index is None or e.round_index == round_index)]
        return max(0, max(pending) - self.now) if pending else 0

    # ------------------------------------------------------------------ collectives
    def ring_allreduce(self, num_elements: int, element_bytes: int) -> None:
        """Count one ring all-reduce among all replicas, and wait out its latency: 2·(N−1)
        hops one after another."""
        for name, sent in zip(self.names, ring_allreduce_bytes(num_elements, element_bytes,
                                                               len(self.names))):
            self.bytes_sent[name] += sent
        self.wait(2 * (len(self.names) - 1) * self.latency_steps)

    def count_bytes(self, sender: str, size_bytes: int) -> None:
        """Bytes sent outside the message queue (a transfer modelled as instantaneous)."""
        self.bytes_sent[sender] += size_bytes

    def mean_bytes_sent(self) -> float:
        return sum(self.bytes_sent.values()) / len(self.bytes_sent)
