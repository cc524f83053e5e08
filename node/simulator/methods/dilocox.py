"""DiLoCoX over the simulated swarm (PROTOCOLS.md §3): compressed pseudo-gradients to everyone.

Each replica runs a protocol.dilocox.DiLoCoX with its own codec instance (the low-rank codec's
warm starts are per node). After round r every replica compresses Δ^r (with its error feedback)
and sends the message to every other replica: the group is the whole simulated swarm (the
daemon's fan-out cap is not modelled). With delay 1 the messages travel while round r+1
computes and are applied at its end; with delay 0 every replica waits for them (idle time).
A message that arrives after its round was applied is late: counted, never applied. When
training stops, delay 1 still owes the last round's messages: `finish` applies them.

Consistency (PROTOCOLS.md §3): after each outer step every replica announces a 16-byte digest of
φ to the others; replicas whose digest differs from the most common one (ties: the digest of
the lowest id) re-download φ and m from the first replica that holds it. Without losses all
digests agree and nothing is re-downloaded.

Bytes: each message counts its exact encoded size once per recipient (N−1 copies: a compressed
message cannot be summed on the way as a ring all-reduce sums fp32), plus the digests and any
re-download of φ and m (fp32), counted to the replica that serves it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from node.simulator.methods.base import Method
from protocol.codecs import Codec, Encoded, get_codec
from protocol.diloco import DiLoCoHyperParameters
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters, ReceiveOutcome, winning_digest
from protocol.tensors import numel, weights_digest

TOPIC = "dilocox-pseudo-gradient"
DIGEST_BYTES = 16  # protocol.tensors.weights_digest: BLAKE2b-128
FP32_BYTES = 4


class SharedDecoding(Codec):
    """One node's codec, whose decodings are shared by every node of the simulation.

    Each DiLoCoX node decodes every message it receives twice (to validate it, then to apply
    it), so N replicas would decode each of N messages 2N times: at 64 replicas that is most
    of a round's time. Decoding is a pure function of (description, payload) (protocol/codecs
    base.py), so one decoding per message gives the same numbers; each caller gets its own
    copy. Encoding stays with the node's own codec (the low-rank warm starts are per node).
    The cache keeps two rounds of messages: with delay 1 a message is applied a round after
    it arrives.
    """

    def __init__(self, inner: Codec, cache: DecodingCache) -> None:
        self.inner, self.cache = inner, cache
        self.name, self.decodes = inner.name, inner.decodes

    def encode(self, tensor: torch.Tensor, name: str = "") -> Encoded:
        return self.inner.encode(tensor, name)

    def decode(self, description: Any, payload: Any, max_elements: int = 1 << 28) -> torch.Tensor:
        key = (bytes(payload), repr(description), max_elements)
        decoded = self.cache.get(key)
        if decoded is None:
            decoded = self.cache.put(key, self.inner.decode(description, payload, max_elements))
        return decoded.clone()

    def _encode(self, values: torch.Tensor, name: str) -> Encoded:  # encode() is delegated whole
        return self.inner.encode(values, name)

    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        return self.inner.decode(description, payload, max_elements)

    def params(self) -> dict[str, Any]:
        return self.inner.params()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)


class DecodingCache:
    """Decoded tensors of this round's and last round's messages."""

    def __init__(self) -> None:
        self.current: dict = {}
        self.previous: dict = {}

    def get(self, key) -> torch.Tensor | None:
        found = self.current.get(key)
        return found if found is not None else self.previous.get(key)

    def put(self, key, tensor: torch.Tensor) -> torch.Tensor:
        self.current[key] = tensor
        return tensor

    def next_round(self) -> None:
        self.previous, self.current = self.current, {}


class DiLoCoXSwarm(Method):
    def __init__(self, settings, replicas, exchange) -> None:
        super().__init__(settings, replicas, exchange)
        hyper = DiLoCoXHyperParameters(DiLoCoHyperParameters(settings.outer_lr, settings.outer_momentum),
                                       delay=settings.delay)
        self.decodings = DecodingCache()
        self.nodes = {r.name: DiLoCoX(r.trainer.named_parameters(),
                                      SharedDecoding(get_codec(settings.codec, **settings.codec_parameters()),
                                                     self.decodings),
                                      r.name, hyper) for r in replicas}
        self.vector_elements = numel(replicas[0].trainer.named_parameters())
        self.last_message_bytes = 0

    def run_round(self, round_index: int) -> None:
        self.decodings.next_round()
        self.inner_phase()
        message_sizes, energies = [], []
        for replica in self.replicas:
            node = self.nodes[replica.name]
            message = node.compress(node.pseudo_gradient(replica.trainer.named_parameters()), round_index)
            message_sizes.append(message.size_bytes)
            energies.extend(message.energy_kept.values())
            for other in self.names:
                if other != replica.name:
                    self.exchange.send(replica.name, other, TOPIC, round_index, message,
                                       message.size_bytes)
        self.last_message_bytes = sum(message_sizes) / len(message_sizes)
        self.counters.energy_kept = sum(energies) / len(energies) if energies else None
        if self.settings.delay == 0:
            self.exchange.wait(self.exchange.time_until_arrival(TOPIC))
        self._deliver_and_step(round_index)

    def finish(self, rounds: int) -> None:
        """With delay 1 the last round's messages are still unapplied when training stops:
        wait for them and apply them (an outer step with no training), so that the final
        weights hold every round's work, as every other method's do."""
        if self.settings.delay == 1:
            self.exchange.wait(self.exchange.time_until_arrival(TOPIC))
            self._deliver_and_step(rounds)

    def _deliver_and_step(self, round_index: int) -> None:
        """Hand every arrived message to its replica, then the outer step of `round_index`."""
        for replica in self.replicas:
            node = self.nodes[replica.name]
            for envelope in self.exchange.collect(replica.name, TOPIC):
                if node.receive(envelope.payload) is ReceiveOutcome.LATE:
                    self.counters.late_messages += 1
        for replica in self.replicas:
            self.nodes[replica.name].outer_step(round_index)
        self._resynchronise()
        for replica in self.replicas:
            replica.load(self.nodes[replica.name].round_start_weights())

    def _resynchronise(self) -> None:
        """The digest check: the minority adopts φ and m of the most common digest."""
        digests = {name: weights_digest(node.slow_weights) for name, node in self.nodes.items()}
        for name in self.names:
            self.exchange.count_bytes(name, DIGEST_BYTES * (len(self.names) - 1))
        majority = winning_digest(Counter(digests.values()))
        provider = next(name for name in sorted(digests) if digests[name] == majority)
        for name, digest in digests.items():
            if digest != majority:
                self.nodes[name].adopt_outer_state(self.nodes[provider].outer_state())
                self.exchange.count_bytes(provider, 2 * self.vector_elements * FP32_BYTES)
                self.counters.resyncs += 1
