"""DiLoCoX's outer loop (PROTOCOLS.md §3, arXiv 2506.21263) as lowcomm-node realises it.

Per node: φ and the outer momentum m (DiLoCo's outer Nesterov, reused from protocol/diloco.py,
not copied) and the error-feedback residual e (starts at 0). Round r:

    Δ^r = φ − θ                               (`pseudo_gradient`)
    c^r = C(Δ^r + e) ;  e ← Δ^r + e − D(c^r)  (`compress`: nothing is lost, only delayed)
    send c^r to the group; receive the others' (`receive`)
    Δ̄ = mean of D(c_j^{r−delay}) over the messages of round r − delay, own included
    m ← μ·m + Δ̄ ;  φ ← φ − η·(Δ̄ + μ·m)      (`outer_step`)

delay = 1 (default) lets round r's messages travel while round r+1 computes; delay = 0 waits
for them, and with the identity codec is exactly DiLoCo.

Invariants:
- Every accepted message is applied exactly once, or dropped and counted: messages are keyed by
  (sender, round); a second message with the same key is a duplicate; a round is applied at most
  once (`last_applied_round` only grows); a message for an applied round is late.
- Every node averages identical numbers in an identical order: all messages, own included, are
  decoded by the same D and summed in sorted sender order, so nodes that applied the same
  messages hold bitwise identical φ and m.
- Only compressed messages are held between rounds (memory ∝ group × compressed size); each is
  fully decoded once on receipt to validate it, and again when applied.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from protocol.codecs.base import Codec, Encoded
from protocol.diloco import DiLoCo, DiLoCoHyperParameters
from protocol.errors import ConfigurationError, LayoutError, ProtocolError
from protocol.tensors import NamedTensors, check_same_layout, fp32_clone, mean, zeros_like


@dataclass(frozen=True)
class DiLoCoXHyperParameters:
    """The outer optimizer, the delay (0 or 1 round) and how far ahead messages may run."""

    outer: DiLoCoHyperParameters = field(default_factory=DiLoCoHyperParameters)
    delay: int = 1
    max_rounds_ahead: int = 8

    def __post_init__(self) -> None:
        if type(self.delay) is not int or self.delay not in (0, 1):
            raise ConfigurationError(f"DiLoCoX delay must be 0 or 1 rounds, got {self.delay!r}.")
        if type(self.max_rounds_ahead) is not int or not 1 <= self.max_rounds_ahead <= 1024:
            raise ConfigurationError(
                f"DiLoCoX max_rounds_ahead must be an int in [1, 1024], got {self.max_rounds_ahead!r}.")


@dataclass(frozen=True)
class PseudoGradientMessage:
    """One node's compressed pseudo-gradient of one round: what goes on the wire."""

    sender: str
    round_index: int
    tensors: Mapping[str, Encoded]

    @property
    def size_bytes(self) -> int:
        """Bytes of all descriptions and payloads (wire headers and signatures not included)."""
        return sum(encoded.size_bytes for encoded in self.tensors.values())

    @property
    def energy_kept(self) -> dict[str, float]:
        """ε per low-rank tensor, measured by the sender's encoder (empty on received messages)."""
        return {name: e.energy_kept for name, e in self.tensors.items() if e.energy_kept is not None}


class ReceiveOutcome(enum.Enum):
    """What `DiLoCoX.receive` did with a well-formed message."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # same (sender, round) already held: dropped
    LATE = "late"            # its round was already applied: dropped
    TOO_EARLY = "too_early"  # beyond max_rounds_ahead: dropped, bounds memory


@dataclass
class DiLoCoXCounters:
    """Running totals, for telemetry."""

    accepted: int = 0
    duplicates: int = 0
    late: int = 0
    too_early: int = 0
    applied_messages: int = 0
    applied_rounds: int = 0
    empty_rounds: int = 0


@dataclass(frozen=True)
class OuterStepRecord:
    """What one `outer_step` applied."""

    round_index: int
    applied_round: int | None  # None: nothing was due (round_index < delay)
    senders: tuple[str, ...]   # empty: no messages for that round, φ and m unchanged


class DiLoCoX:
    """One node's DiLoCoX state: φ, m (inside a DiLoCo), residual e, and pending messages."""

    def __init__(self, initial_weights: Mapping[str, torch.Tensor], codec: Codec, node_id: str,
                 hyper: DiLoCoXHyperParameters | None = None) -> None:
        if not isinstance(node_id, str) or not node_id:
            raise ConfigurationError("DiLoCoX node_id must be a non-empty string.")
        self.hyper = hyper if hyper is not None else DiLoCoXHyperParameters()
        self.codec = codec
        self.node_id = node_id
        self._outer = DiLoCo(initial_weights, self.hyper.outer)
        self._residual = zeros_like(self._outer.slow_weights)
        self._shapes = {name: t.shape for name, t in self._residual.items()}
        self._pending: dict[int, dict[str, PseudoGradientMessage]] = {}
        self.last_applied_round = -1
        self.last_compressed_round = -1
        self.counters = DiLoCoXCounters()
        self.last_step: OuterStepRecord | None = None

    # ------------------------------------------------------------------ views (copies)
    @property
    def slow_weights(self) -> NamedTensors:
        """A copy of φ."""
        return self._outer.slow_weights

    @property
    def momentum(self) -> NamedTensors:
        """A copy of the outer momentum m."""
        return self._outer.momentum

    @property
    def residual(self) -> NamedTensors:
        """A copy of the error-feedback residual e."""
        return fp32_clone(self._residual, what="residual")

    # ------------------------------------------------------------------ one round
    def pseudo_gradient(self, fast_weights: Mapping[str, torch.Tensor]) -> NamedTensors:
        """Δ = φ − θ at the end of a round."""
        return self._outer.pseudo_gradient(fast_weights)

    def compress(self, delta: Mapping[str, torch.Tensor], round_index: int) -> PseudoGradientMessage:
        """c = C(Δ + e), e ← Δ + e − D(c); the message is also kept as this node's own."""
        if type(round_index) is not int or round_index <= max(self.last_compressed_round,
                                                               self.last_applied_round):
            raise ProtocolError(
                f"compress round {round_index!r} must be an int above the last compressed round "
                f"{self.last_compressed_round} and the last applied round {self.last_applied_round}.")
        check_same_layout(self._residual, delta, what="pseudo-gradient")
        encoded: dict[str, Encoded] = {}
        new_residual: NamedTensors = {}
        for name, residual in self._residual.items():
            target = delta[name].detach().to(torch.float32) + residual
            encoded[name] = self.codec.encode(target, name)
            sent = self.codec.decode(encoded[name].description, encoded[name].payload,
                                     max_elements=max(target.numel(), 1))
            new_residual[name] = target - sent
        self._residual = new_residual  # only once every tensor encoded: no half-updated e
        message = PseudoGradientMessage(self.node_id, round_index, encoded)
        self.last_compressed_round = round_index
        self._store(message)
        return message

    def receive(self, message: PseudoGradientMessage) -> ReceiveOutcome:
        """Validate and hold a peer's message until its round is applied.

        Malformed messages (wrong names, shapes, bad encodings) raise LayoutError or CodecError;
        late, duplicate or too-early ones are dropped, counted, and reported by the outcome.
        """
        if not isinstance(message, PseudoGradientMessage) or not isinstance(message.sender, str) \
                or not message.sender or type(message.round_index) is not int or message.round_index < 0:
            raise ProtocolError("a DiLoCoX message needs a non-empty sender and a round index >= 0.")
        outcome = self._admission(message)
        if outcome is not ReceiveOutcome.ACCEPTED:
            return outcome
        self._decoded(message)  # validates every tensor; the result is dropped, see invariants
        self._store(message)
        return outcome

    def outer_step(self, round_index: int) -> NamedTensors:
        """At the end of round `round_index`, apply round `round_index − delay`; returns φ."""
        if type(round_index) is not int or round_index < 0:
            raise ProtocolError(f"outer_step round must be an int >= 0, got {round_index!r}.")
        target = round_index - self.hyper.delay
        if 0 <= target <= self.last_applied_round:
            raise ProtocolError(f"outer_step round {round_index!r} would apply round {target}, "
                                f"but round {self.last_applied_round} was already applied.")
        if target < 0:
            self.last_step = OuterStepRecord(round_index, None, ())
            return self.slow_weights
        for stale_round in [r for r in self._pending if r < target]:
            self.counters.late += len(self._pending.pop(stale_round))  # skipped: never applied
        messages = self._pending.pop(target, {})
        senders = tuple(sorted(messages))
        self.last_applied_round = target
        self.last_step = OuterStepRecord(round_index, target, senders)
        if not senders:
            self.counters.empty_rounds += 1
            return self.slow_weights
        self.counters.applied_messages += len(senders)
        self.counters.applied_rounds += 1
        # Sorted sender order: every node sums the same numbers in the same order.
        return self._outer.apply_mean(mean(self._decoded(messages[s]) for s in senders))

    # ------------------------------------------------------------------ helpers
    def _admission(self, message: PseudoGradientMessage) -> ReceiveOutcome:
        """Duplicate, late, too early, or accepted; counts what it drops."""
        if message.round_index <= self.last_applied_round:
            self.counters.late += 1
            return ReceiveOutcome.LATE
        if message.round_index > self.last_applied_round + self.hyper.max_rounds_ahead:
            self.counters.too_early += 1
            return ReceiveOutcome.TOO_EARLY
        if message.sender in self._pending.get(message.round_index, {}):
            self.counters.duplicates += 1
            return ReceiveOutcome.DUPLICATE
        return ReceiveOutcome.ACCEPTED

    def _store(self, message: PseudoGradientMessage) -> None:
        self._pending.setdefault(message.round_index, {})[message.sender] = message
        self.counters.accepted += 1

    def _decoded(self, message: PseudoGradientMessage) -> NamedTensors:
        """D(c) per tensor, checked against this model's names and shapes."""
        if not isinstance(message.tensors, Mapping) or message.tensors.keys() != self._shapes.keys():
            raise LayoutError(f"message from {message.sender!r} does not carry exactly this "
                              "model's tensor names.")
        decoded: NamedTensors = {}
        for name, shape in self._shapes.items():
            encoded = message.tensors[name]
            if not isinstance(encoded, Encoded):
                raise LayoutError(f"message from {message.sender!r} holds a non-Encoded {name!r}.")
            tensor = self.codec.decode(encoded.description, encoded.payload,
                                       max_elements=max(shape.numel(), 1))
            if tensor.shape != shape:
                raise LayoutError(f"message from {message.sender!r} decodes {name!r} to shape "
                                  f"{tuple(tensor.shape)}, expected {tuple(shape)}.")
            decoded[name] = tensor
        return decoded

    def pending_rounds(self) -> dict[int, tuple[str, ...]]:
        """Rounds held but not yet applied, with their senders (sorted)."""
        return {r: tuple(sorted(m)) for r, m in sorted(self._pending.items())}

    # ------------------------------------------------------------------ checkpoints
    def outer_state(self) -> dict[str, Any]:
        """φ and m alone: what a diverged node downloads from a majority peer."""
        return self._outer.state_dict()

    def adopt_outer_state(self, state: Mapping[str, Any]) -> None:
        """Replace φ and m by a peer's `outer_state()` (PROTOCOLS.md §3 "Consistency")."""
        self._outer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: φ, m, e, codec state, pending messages, counters."""
        pending = {r: {s: {n: {"description": e.description, "payload": e.payload}
                           for n, e in m.tensors.items()} for s, m in msgs.items()}
                   for r, msgs in self._pending.items()}
        return {"outer": self._outer.state_dict(), "residual": self.residual,
                "codec": {"name": self.codec.name, "params": self.codec.params(),
                          "state": self.codec.state_dict()},
                "pending": pending, "last_applied_round": self.last_applied_round,
                "last_compressed_round": self.last_compressed_round,
                "counters": asdict(self.counters)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output; the codec must be of the same kind as this node's."""
        try:
            codec_name, codec_state = state["codec"]["name"], state["codec"]["state"]
            residual, pending, outer = state["residual"], state["pending"], state["outer"]
            applied, compressed = state["last_applied_round"], state["last_compressed_round"]
            counters = DiLoCoXCounters(**state["counters"])
        except (KeyError, TypeError) as missing:
            raise LayoutError(f"DiLoCoX state lacks or mangles the field {missing}.") from None
        if codec_name != self.codec.name:
            raise ConfigurationError(f"checkpoint was written with codec {codec_name!r}, "
                                     f"this node uses {self.codec.name!r}.")
        check_same_layout(self._residual, residual, what="checkpoint residual")
        self._outer.load_state_dict(outer)
        self.codec.load_state_dict(codec_state)
        self._residual = fp32_clone(residual, what="checkpoint residual")
        self._pending = {int(r): {s: PseudoGradientMessage(s, int(r), {
            n: Encoded(t["description"], t["payload"]) for n, t in tensors.items()})
            for s, tensors in msgs.items()} for r, msgs in pending.items()}
        self.last_applied_round, self.last_compressed_round = int(applied), int(compressed)
        self.counters = counters

