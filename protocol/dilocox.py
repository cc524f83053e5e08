"""DiLoCoX's outer loop (docs/protocols.md §3, arXiv 2506.21263) as lowcomm-node realises it.

Per node: φ and the outer momentum m (DiLoCo's outer Nesterov, reused from protocol/diloco.py,
not copied), the error-feedback residual e (starts at 0), and f, this node's own decoded
messages still in flight. Round r:

    θ ← s = φ − e − λ·Σ_f D(c_own)            (`round_start_weights`; λ: `in_flight_share`)
    H inner steps ; Δ^r = s − θ                (`pseudo_gradient`: this round's progress only)
    c^r = C(Δ^r + β·e) ; e ← Δ^r + β·e − D(c^r)  (`compress`; β = 1: nothing is lost, only delayed)
    f[r] = D(c^r) ; send c^r to the group; receive the others' (`receive`)
      (a node outside round r's committee, protocol/committee.py, sends nothing: k ← β_k·k + Δ^r,
       `keep`, and its next message is c = C(Δ + β_k·k + β·e): it carries n rounds, of weight
       w(n) = 1 + β_k + … + β_k^(n−1); with β_k = 0, the default, only its fresh round)
    Δ̄ = Σ_j a_j·D(c_j) / Σ_j w(n_j) over the senders j of round r − delay, own included
        (w = 1 when every member sends every round: the mean),
        a_j = min(1, w(n_j)·median_k(‖D(c_k)‖ / w(n_k)) / ‖D(c_j)‖) with `clip_to_median`, else 1;
        with `noise_ratio` ρ > 0 and at least 3 senders, j is left out when
        s_j = s(D(c_j), Σ_{k≠j} |D(c_k)|) < max(5/√N, ρ · median_k s_k)
        (s: protocol/structure.py; unless that would leave no one)
    m ← μ·m + Δ̄ ;  φ ← φ − η·(Δ̄ + μ·m)      (`outer_step`, which drops f[r − delay])

λ is ½ (`overlap = "half"`) or, `overlap = "eager"` (arXiv 2502.12996), the weight the node's
own message will have in φ's step once its round is applied: η·(1 + μ)/n with Nesterov (η/n
without), n the rounds of work the last round applied carried (its senders when all send
every round). Own fresh work then counts at once at its share, the peers' one round later.
β < 1 is SparseLoCo's decaying error buffer (0.95 there):
it forgets what a codec kept back for long, trading the invariant sent + e = ΣΔ for a residual
that cannot grow without bound. Median clipping (Templar's) bounds what one sender can move φ
by; every node computes the same factors from the same messages. The noise filter (`noise_filter`)
judges each sender against the others of its round: honest pseudo-gradients move the same
coordinates by similar amounts, noise of a plausible norm does not; it too is computed from the
messages alone, so every node leaves out the same senders and φ stays identical.

With delay 0, the identity codec, β = 1 and no clipping, e = 0 and f is empty at every round
start: exactly DiLoCo.

Why a round does not start from φ (docs/protocols.md §3), as a first design had it (θ ← φ):
- With delay 1 that φ lacks the node's own last round, so the next round redoes much of that
  progress and the outer step then applies both (each message once, but the same progress
  twice): a linear model's iteration has spectral radius 0.99 instead of 0.30. So the round in flight stays in the node's own weights, at weight λ, until
  the group's mean of that round replaces it. λ = 1 (θ continues where the round ended) fixes
  the repetition, but then the replicas keep their whole last round apart, and in directions
  an inner phase converges fully that deviation never decays (in a noisy linear model the
  iteration is marginally stable). λ = 1/8 oscillates like λ = 0. λ = ½ (the default) contracts by 0.56-0.71 per round (μ = 0.3) in the
  noiseless linear model, whatever fraction of a direction a round converges, and stays near
  the noise floor with noise (tests/unit/test_dilocox.py).
- With a lossy codec, φ holds only the compressed part of the node's own work; the rest waits
  in e for later rounds. Training from φ alone throws that work away for now, so heavy
  compression could end worse than training alone. Keeping e in the node's own weights means a node trains on all of its own
  work plus the swarm's consensus: with a codec that sends nothing it is local training.
- §3 lists "a committee of senders, error feedback keeping the work of nodes that do not send
  this round". The committee is built (protocol/committee.py); keeping the others' work is
  `kept_decay` = 1, and it loses to sending the fresh round alone: a round kept waits N/k
  rounds on average before it is sent, and φ stepping on work that stale costs more than the
  work gives. So by default (`kept_decay` = 0) a round outside the committee is not sent: at
  the committee's size, more senders' rounds add little.
The measurements behind these choices: benchmarks/NOTEBOOK.md, "DiLoCoX diagnostics" and
"DiLoCoX at 32 replicas".
φ stays bitwise identical on every node and every message is still applied exactly once; a
node's weights differ from φ by its own e and its share of its rounds in flight.

Invariants:
- Every accepted message is applied exactly once, or dropped and counted: messages are keyed by
  (sender, round); a second message with the same key is a duplicate; a round is applied at most
  once (`last_applied_round` only grows); a message for an applied round is late.
- Every node averages identical numbers in an identical order: all messages, own included, are
  decoded by the same D and summed in sorted sender order, so nodes that applied the same
  messages hold bitwise identical φ and m, on any CPU: D and the outer step round each product
  and sum once, with no matmul and no fused multiply-add (protocol/codecs/lowrank.py
  `outer_sum`, protocol/diloco.py).
- f holds at most `delay` rounds: `outer_step` drops every round up to the one it applies, and
  a node that adopts a state to rejoin at another round drops f and its own pending messages
  (the swarm is past those rounds).
- `replay` of a step from the state before it over the same messages gives bitwise the state
  that step gave: a node that applied another set rebuilds the majority's φ from its messages.
- Only compressed messages are held between rounds (memory ∝ group × compressed size); each is
  fully decoded once on receipt to validate it, and again when applied.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from protocol.codecs.base import Codec, Encoded
from protocol.diloco import DiLoCo, DiLoCoHyperParameters
from protocol.errors import ConfigurationError, LayoutError, ProtocolError
from protocol.structure import magnitude_score
from protocol.tensors import NamedTensors, check_same_layout, difference, fp32_clone, mean, \
    squared_norm, zeros_like


OVERLAPS = ("half", "eager")
# the most rounds of work one message may say it carries: at a send share of 1/8 a member goes
# 64 rounds without sending with probability (7/8)^64 = 0.02%; a larger claim would only shrink
# everyone's step (its weight is in the divisor), and is refused
MAX_ROUNDS_CARRIED = 64


@dataclass(frozen=True)
class DiLoCoXHyperParameters:
    """The outer optimizer, the delay (0 or 1 round), how far ahead messages may run, λ (the
    weight of the node's own round in flight in the weights it trains: `overlap` "half" is
    `in_flight_weight`, "eager" its share of the outer step, see `in_flight_share`), β (the
    residual's decay), β_k (`kept_decay`: what a round sat out of a committee still weighs in
    the next message), and whether each message is clipped to the median norm before the mean."""

    outer: DiLoCoHyperParameters = field(default_factory=DiLoCoHyperParameters)
    delay: int = 1
    max_rounds_ahead: int = 8
    in_flight_weight: float = 0.5
    overlap: str = "half"
    residual_decay: float = 1.0
    kept_decay: float = 0.0
    clip_to_median: bool = False
    noise_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAPS:
            raise ConfigurationError(f"DiLoCoX overlap must be one of {list(OVERLAPS)}, got {self.overlap!r}.")
        for name, low, high, low_open in (("residual_decay", 0, 1, True), ("noise_ratio", 0, 1, False),
                                          ("kept_decay", 0, 1, False), ("in_flight_weight", 0, 1, False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (low < value if low_open else low <= value) or not value <= high:
                span = f"{'(' if low_open else '['}{low}, {high}]"
                raise ConfigurationError(f"DiLoCoX {name} must be a number in {span}, got {value!r}.")
        if not isinstance(self.clip_to_median, bool):
            raise ConfigurationError(f"DiLoCoX clip_to_median must be a bool, got {self.clip_to_median!r}.")
        if type(self.delay) is not int or self.delay not in (0, 1):
            raise ConfigurationError(f"DiLoCoX delay must be 0 or 1 rounds, got {self.delay!r}.")
        if type(self.max_rounds_ahead) is not int or not 1 <= self.max_rounds_ahead <= 1024:
            raise ConfigurationError(
                f"DiLoCoX max_rounds_ahead must be an int in [1, 1024], got {self.max_rounds_ahead!r}.")

    def carried_weight(self, rounds: int) -> float:
        """w(n) = 1 + β_k + … + β_k^(n−1): the rounds of work a message of n rounds holds."""
        beta = self.kept_decay
        return float(rounds) if beta == 1 else (1 - beta ** rounds) / (1 - beta)


@dataclass(frozen=True)
class PseudoGradientMessage:
    """One node's compressed pseudo-gradient of one round: what goes on the wire."""

    sender: str
    round_index: int
    tensors: Mapping[str, Encoded]
    rounds: int = 1  # rounds of the sender's work it carries (more when it sat out committees)

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
    clipped: int = 0  # messages scaled down to the median norm (clip_to_median)
    left_out: int = 0  # messages left out as noise (noise_ratio)


@dataclass(frozen=True)
class OuterStepRecord:
    """What one `outer_step` applied."""

    round_index: int
    applied_round: int | None  # None: nothing was due (round_index < delay)
    senders: tuple[str, ...]   # empty: no messages for that round, φ and m unchanged
    left_out: tuple[str, ...] = ()  # senders whose message the noise filter left out


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
        self._kept = zeros_like(self._residual)  # k: Δ of the rounds outside the committee
        self._shapes = {name: t.shape for name, t in self._residual.items()}
        self._pending: dict[int, dict[str, PseudoGradientMessage]] = {}
        self._in_flight: dict[int, NamedTensors] = {}  # f: round -> D(c_own)
        self.last_applied_round = -1
        self.last_compressed_round = -1
        self.counters = DiLoCoXCounters()
        self.last_step: OuterStepRecord | None = None
        self.last_messages: dict[str, PseudoGradientMessage] = {}  # what the last step applied (`replay`)
        self._last_group_size = 0  # rounds carried by the last round applied: the eager share's n
        self._kept_rounds = 0  # rounds kept in k since our last message (`keep`)

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
        """A copy of e plus what the next message carries of the rounds kept outside the
        committee, β_k·k: what the node's work has not sent yet and will."""
        return {name: e + self.hyper.kept_decay * self._kept[name]
                for name, e in self._residual.items()}

    # ------------------------------------------------------------------ one round
    def round_start_weights(self) -> NamedTensors:
        """s = φ − e − σ·k − λ·Σ D(c_own) over the own rounds in flight: where a round starts
        (k: the rounds kept outside the committee, σ: `own_share`)."""
        start = self._outer.slow_weights_minus(self._residual)
        share, kept_share = self.in_flight_share(), self.own_share()
        for name, tensor in start.items():
            tensor.sub_(self._kept[name], alpha=kept_share)
            for decoded in self._in_flight.values():
                tensor.sub_(decoded[name], alpha=share)
        return start

    def in_flight_share(self) -> float:
        """λ. "half": `in_flight_weight`. "eager": `own_share`."""
        return self.hyper.in_flight_weight if self.hyper.overlap == "half" else self.own_share()

    def own_share(self) -> float:
        """σ: the share the node's own work will have in φ's step when it is applied,
        η·(1 + μ)/n with Nesterov (η/n without), n the rounds of work the last round applied
        carried, its senders when all send every round (1 before any). Own work counts at once
        at the weight it will have, as the peers' counts when it arrives: a node that counted
        the rounds it kept outside the committee whole would count the swarm's common progress
        twice, once in φ (the others' messages) and once in its own rounds."""
        outer = self.hyper.outer
        step = outer.outer_lr * ((1 + outer.momentum) if outer.nesterov else 1)
        return step / max(1, self._last_group_size)

    def pseudo_gradient(self, fast_weights: Mapping[str, torch.Tensor]) -> NamedTensors:
        """Δ = s − θ at the end of a round: the progress of this round alone."""
        return difference(self.round_start_weights(), fast_weights)

    def keep(self, delta: Mapping[str, torch.Tensor], round_index: int) -> None:
        """A round outside the committee: k ← β_k·k + Δ, nothing sent; the next message carries it.
        The encoder still follows what it would have sent, Δ + β_k·k + β·e (`Codec.track`)."""
        self._check_next_round(round_index, delta)
        beta = self.hyper.kept_decay
        kept_now: NamedTensors = {}
        for name, kept in self._kept.items():
            self.codec.track(self._target(delta, name), name)
            kept_now[name] = beta * kept + delta[name].detach().to(torch.float32)
        self._kept = kept_now
        self._kept_rounds += 1
        self.last_compressed_round = round_index

    def compress(self, delta: Mapping[str, torch.Tensor], round_index: int) -> PseudoGradientMessage:
        """c = C(Δ + β_k·k + β·e), e ← Δ + β_k·k + β·e − D(c), k ← 0; the message is also kept
        as this node's own."""
        self._check_next_round(round_index, delta)
        encoded: dict[str, Encoded] = {}
        new_residual: NamedTensors = {}
        decoded: NamedTensors = {}
        for name in self._residual:
            target = self._target(delta, name)
            encoded[name] = self.codec.encode(target, name)
            decoded[name] = self.codec.decode(encoded[name].description, encoded[name].payload,
                                              max_elements=max(target.numel(), 1))
            new_residual[name] = target - decoded[name]
        self._residual = new_residual  # only once every tensor encoded: no half-updated e
        self._kept = zeros_like(new_residual)
        self._in_flight[round_index] = decoded
        message = PseudoGradientMessage(self.node_id, round_index, encoded,
                                        min(self._kept_rounds + 1, MAX_ROUNDS_CARRIED))
        self._kept_rounds = 0
        self.last_compressed_round = round_index
        self._store(message)
        return message

    def _target(self, delta: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        """x = Δ + β_k·k + β·e for tensor `name`: what this round's message encodes."""
        return delta[name].detach().to(torch.float32) \
            + self._kept[name] * self.hyper.kept_decay + self._residual[name] * self.hyper.residual_decay

    def _check_next_round(self, round_index: int, delta: Mapping[str, torch.Tensor]) -> None:
        if type(round_index) is not int or round_index <= max(self.last_compressed_round,
                                                               self.last_applied_round):
            raise ProtocolError(
                f"compress round {round_index!r} must be an int above the last compressed round "
                f"{self.last_compressed_round} and the last applied round {self.last_applied_round}.")
        check_same_layout(self._residual, delta, what="pseudo-gradient")

    def receive(self, message: PseudoGradientMessage) -> ReceiveOutcome:
        """Validate and hold a peer's message until its round is applied.

        Malformed messages (wrong names, shapes, bad encodings) raise LayoutError or CodecError;
        late, duplicate or too-early ones are dropped, counted, and reported by the outcome.
        """
        if not isinstance(message, PseudoGradientMessage) or not isinstance(message.sender, str) \
                or not message.sender or type(message.round_index) is not int or message.round_index < 0:
            raise ProtocolError("a DiLoCoX message needs a non-empty sender and a round index >= 0.")
        if type(message.rounds) is not int or not 1 <= message.rounds <= MAX_ROUNDS_CARRIED:
            raise ProtocolError(f"a DiLoCoX message carries 1 to {MAX_ROUNDS_CARRIED} rounds of "
                                f"work, this one says {message.rounds!r}.")
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
            self.last_step, self.last_messages = OuterStepRecord(round_index, None, ()), {}
            return self.slow_weights
        for stale_round in [r for r in self._pending if r < target]:
            self.counters.late += len(self._pending.pop(stale_round))  # skipped: never applied
        messages = self._pending.pop(target, {})
        self.last_messages = messages
        senders, left_out, clipped, mean_update = self._aggregate(messages)
        self.counters.left_out += len(left_out)
        self.counters.clipped += clipped
        self.last_applied_round = target
        for own_round in [r for r in self._in_flight if r <= target]:
            del self._in_flight[own_round]  # φ now holds it, through the group's mean
        self.last_step = OuterStepRecord(round_index, target, senders, left_out)
        if mean_update is None:
            self.counters.empty_rounds += 1
            return self.slow_weights
        self.counters.applied_messages += len(senders)
        self.counters.applied_rounds += 1
        self._last_group_size = sum(self.hyper.carried_weight(messages[s].rounds) for s in senders)
        return self._outer.apply_mean(mean_update)

    def replay(self, before: Mapping[str, Any], messages: Mapping[str, PseudoGradientMessage]
               ) -> dict[str, Any]:
        """The outer state (`outer_state()`'s form: φ and m) that one outer step over exactly
        `messages` takes `before` to, this node's own state untouched: how a node whose φ left
        the majority's, having applied another set of messages, rebuilds the majority's φ from
        its state before that step and the majority's messages (kilobytes), where a resync
        downloads φ and m whole. The same aggregation as `outer_step` (noise filter, clipping,
        the mean in sorted sender order), so the same messages give bitwise the same state."""
        scratch = DiLoCo(before["slow_weights"], self.hyper.outer)
        scratch.load_state_dict(before)
        _, _, _, mean_update = self._aggregate(messages)
        if mean_update is not None:
            scratch.apply_mean(mean_update)
        return scratch.state_dict()

    def _aggregate(self, messages: Mapping[str, PseudoGradientMessage]
                   ) -> tuple[tuple[str, ...], tuple[str, ...], int, NamedTensors | None]:
        """(senders applied, senders left out as noise, messages clipped, Δ̄ or None when no
        sender is left): the part of the outer step that depends on the messages alone."""
        senders = tuple(sorted(messages))
        left_out = self._noise(messages, senders) if self.hyper.noise_ratio > 0 else ()
        senders = tuple(s for s in senders if s not in left_out)
        if not senders:
            return senders, left_out, 0, None
        # Sorted sender order: every node sums the same numbers in the same order.
        scales = self._median_clip(messages, senders) if self.hyper.clip_to_median else {}
        return senders, left_out, len(scales), mean(
            (self._scaled(self._decoded(messages[s]), scales.get(s, 1.0)) for s in senders),
            divisor=sum(self.hyper.carried_weight(messages[s].rounds) for s in senders))

    # ------------------------------------------------------------------ helpers
    def _median_clip(self, messages: Mapping[str, PseudoGradientMessage],
                     senders: tuple[str, ...]) -> dict[str, float]:
        """min(1, w_j·median_k(‖D(c_k)‖ / w_k) / ‖D(c_j)‖) per sender: no message outweighs the
        median one per round of work it carries (w: `carried_weight`; 1 when everyone sends every
        round, or with β_k = 0).

        One decoding at a time (memory stays one message); each norm is summed in an order fixed
        by the shapes alone (`squared_norm`), so every node computes the same factors from the
        same messages, whatever its hardware."""
        norms = {s: math.sqrt(squared_norm(self._decoded(messages[s]))) for s in senders}
        weight = {s: self.hyper.carried_weight(messages[s].rounds) for s in senders}
        median = statistics.median(n / weight[s] for s, n in norms.items())
        return {s: median * weight[s] / n for s, n in norms.items() if n > median * weight[s]}

    def _noise(self, messages: Mapping[str, PseudoGradientMessage],
               senders: tuple[str, ...]) -> tuple[str, ...]:
        """The senders whose message follows the magnitudes of the others' less than ρ times the
        median sender does (or no better than noise). Two decodings per message, one at a time
        (plus the sum of magnitudes); sums in sorted sender order: the same on every node."""
        if len(senders) < 3:
            return ()
        total = zeros_like(self._residual)
        for s in senders:
            for name, tensor in self._decoded(messages[s]).items():
                total[name].add_(tensor.abs())
        scores, elements = {}, 0
        for s in senders:
            decoded = self._decoded(messages[s])
            others = {name: total[name] - tensor.abs() for name, tensor in decoded.items()}
            scores[s], elements = magnitude_score(decoded, others)
        bar = max(5.0 / math.sqrt(max(elements, 1)),
                  self.hyper.noise_ratio * statistics.median(scores.values()))
        out = tuple(s for s in senders if scores[s] < bar)
        return () if len(out) == len(senders) else out

    @staticmethod
    def _scaled(decoded: NamedTensors, scale: float) -> NamedTensors:
        if scale != 1.0:
            for tensor in decoded.values():
                tensor.mul_(scale)
        return decoded

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

    def adopt_outer_state(self, state: Mapping[str, Any], *, rejoin: bool = False) -> None:
        """Replace φ and m by a peer's `outer_state()` (docs/protocols.md §3 "Consistency").

        A resync within the same round keeps f: our messages of those rounds are still applied
        by every node. `rejoin=True` (a late join or catch-up to another round) drops f and our
        own pending messages: the swarm has moved past their rounds.
        """
        self._outer.load_state_dict(state)
        if rejoin:
            for messages in self._pending.values():
                messages.pop(self.node_id, None)
            self._in_flight.clear()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: φ, m, e, codec state, pending messages, counters."""
        pending = {r: {s: {n: {"description": e.description, "payload": e.payload}
                           for n, e in m.tensors.items()} for s, m in msgs.items()}
                   for r, msgs in self._pending.items()}
        return {"outer": self._outer.state_dict(),
                "residual": fp32_clone(self._residual, what="residual"),
                "kept": fp32_clone(self._kept, what="kept rounds"),
                "codec": {"name": self.codec.name, "params": self.codec.params(),
                          "state": self.codec.state_dict()},
                "pending": pending,
                "pending_rounds": {r: {s: m.rounds for s, m in msgs.items()}
                                   for r, msgs in self._pending.items()},
                "kept_rounds": self._kept_rounds,
                "in_flight": {r: fp32_clone(d, what="in-flight message")
                              for r, d in self._in_flight.items()},
                "last_applied_round": self.last_applied_round,
                "last_compressed_round": self.last_compressed_round,
                "last_group_size": self._last_group_size,
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
        carried = state.get("pending_rounds", {})  # absent in older checkpoints: 1 round each
        self._pending = {int(r): {s: PseudoGradientMessage(s, int(r), {
            n: Encoded(t["description"], t["payload"]) for n, t in tensors.items()},
            int(carried.get(r, {}).get(s, 1)))
            for s, tensors in msgs.items()} for r, msgs in pending.items()}
        self._kept_rounds = int(state.get("kept_rounds", 0))
        kept = state.get("kept")  # absent in older checkpoints: no round kept
        if kept is not None:
            check_same_layout(self._residual, kept, what="checkpoint kept rounds")
        self._kept = fp32_clone(kept, what="checkpoint kept rounds") if kept is not None \
            else zeros_like(self._residual)
        in_flight = {}
        try:
            for r, decoded in state.get("in_flight", {}).items():  # absent in older checkpoints
                check_same_layout(self._residual, decoded, what="checkpoint in-flight message")
                in_flight[int(r)] = fp32_clone(decoded, what="checkpoint in-flight message")
        except (TypeError, ValueError) as wrong:
            raise LayoutError(f"DiLoCoX state mangles its messages in flight ({wrong}).") from None
        self._in_flight = in_flight
        self.last_applied_round, self.last_compressed_round = int(applied), int(compressed)
        self._last_group_size = int(state.get("last_group_size", 0))  # absent in older checkpoints
        self.counters = counters

