"""Per-round adaptation of DiLoCoX's compression strength, bits and H (docs/protocols.md §3 "Adaptation").

The strength of a tensor is its rank with the low-rank codec, its k (entries per chunk) with
the top-k codec; the rules below call both "rank". bits are the low-rank factors' (4, 8) or
the top-k values' (2, 4, 8).

A pure decision: `AdaptiveController.decide(settings, measurements)` reads last round's
numbers and returns new settings with a record of every change and its reason, to be reported
each round. It keeps no state between rounds, so tests drive it with made-up measurements.

The rules, with r = send_seconds / compute_seconds and B = overlap_budget (default 0.5):

1. Over budget (r > B): bandwidth first. Lower every rank above the floor; if all ranks are at
   the floor, lower bits; if bits are at the floor too, raise H (fewer, longer rounds).
2. Otherwise, per tensor: energy kept ε above `energy_high` lowers its k (pseudo-gradients grow
   lower-rank as training goes on); ε below `energy_target` raises it.
3. Far under budget (r ≤ slack_ratio·B): spend the slack, undoing earlier retreats first:
   lower H towards its floor, then raise bits, then raise k of tensors not already kept well.

Every upward move (more rank, more bits, smaller H) is taken only if the projected ratio stays
within budget. Bytes are projected per tensor, each in proportion to its rank, and in proportion
to bits; compute time to H:

    r' = max(r, r_s) · (B_other + Σ_i b_i · k'_i / k_i) / B · (bits' / bits) · (H / H')

r_s (`shared_send_seconds` over compute, 0 if not measured) is what the busiest receiver's
downlink would take for every member's message of this size: every member sends it one, so a
receiver that took our message longer than the others did carries N − 1 such messages a round.
It only holds moves up, never forces one down: measured while the senders' pushes overlapped
there, it counts their sharing twice. Three fast senders each grew from 197 to 391 KiB on their
own slack while the others did, 18 s of a 512 kbit/s member's downlink against 12 s rounds, and
waited for it (benchmarks/NOTEBOOK.md, "A diverged DiLoCoX node replays its steps", the 512 kbit/s
runs). And no move up while the last one is still being measured (`growth_allowed` False, its
caller's count of rounds): a link that lets a burst through at once (a token bucket) costs nothing
per byte below the burst, and three fast nodes read slack and doubled their messages, 53 to 408 KiB
in three rounds, onto it.

with b_i the bytes tensor i took in the measured message, B its total and B_other = B − Σ_i b_i
(tensors that do not adapt). Without per-tensor bytes, Σ k'_i / Σ k_i stands for the bytes: a
sum of ranks weighs a 64-wide bias like a 256 x 4096 embedding, under-projected a doubling of the
large tensors' ranks, and the rank went 32-64-32 round after round on a saturated link
(benchmarks/NOTEBOOK.md, "One of 4 nodes on a link 4x slower"). A move held back by that check is
recorded in `held_back`. k, bits and H never leave
their configured bounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from protocol.codecs.lowrank import LowRankCodec
from protocol.codecs.topk import TopKCodec
from protocol.errors import ConfigurationError


@dataclass(frozen=True)
class ControllerConfig:
    """Bounds and thresholds of the adaptation."""

    min_rank: int = 1
    max_rank: int = 64
    bits_choices: tuple[int, ...] = (4, 8)
    min_inner_steps: int = 50      # also where H returns to when bandwidth allows
    max_inner_steps: int = 2000
    energy_target: float = 0.8     # ε below this raises k
    energy_high: float = 0.95      # ε above this ("well above") lowers k
    overlap_budget: float = 0.5    # send may take this fraction of the round's compute time
    slack_ratio: float = 0.5       # "far under budget": r ≤ slack_ratio · overlap_budget
    rank_factor: float = 2.0       # k moves by ×/÷ this (at least by 1)
    inner_steps_factor: float = 2.0

    def __post_init__(self) -> None:
        def require(ok: bool, sentence: str) -> None:
            if not ok:
                raise ConfigurationError(sentence)
        require(_is_int(self.min_rank) and _is_int(self.max_rank)
                and 1 <= self.min_rank <= self.max_rank,
                "controller ranks need ints 1 <= min_rank <= max_rank, "
                f"got {self.min_rank!r}, {self.max_rank!r}.")
        require(isinstance(self.bits_choices, tuple) and len(self.bits_choices) > 0
                and list(self.bits_choices) == sorted(set(self.bits_choices))
                and set(self.bits_choices) <= {2, 4, 8},
                "controller bits_choices must be an ascending tuple from (2, 4, 8), "
                f"got {self.bits_choices!r}.")
        require(_is_int(self.min_inner_steps) and _is_int(self.max_inner_steps)
                and 1 <= self.min_inner_steps <= self.max_inner_steps,
                "controller inner steps need ints 1 <= min_inner_steps <= max_inner_steps, got "
                f"{self.min_inner_steps!r}, {self.max_inner_steps!r}.")
        require(_is_number(self.energy_target) and _is_number(self.energy_high)
                and 0 < self.energy_target < self.energy_high <= 1,
                "controller energies need 0 < energy_target < energy_high <= 1, got "
                f"{self.energy_target!r}, {self.energy_high!r}.")
        require(_is_number(self.overlap_budget) and self.overlap_budget > 0,
                f"controller overlap_budget must be > 0, got {self.overlap_budget!r}.")
        require(_is_number(self.slack_ratio) and 0 < self.slack_ratio < 1,
                f"controller slack_ratio must be in (0, 1), got {self.slack_ratio!r}.")
        require(_is_number(self.rank_factor) and self.rank_factor > 1
                and _is_number(self.inner_steps_factor) and self.inner_steps_factor > 1,
                "controller rank_factor and inner_steps_factor must be numbers > 1.")


@dataclass(frozen=True)
class CompressionSettings:
    """What the controller decides: rank per low-rank tensor, bits of P and Q, inner steps H."""

    ranks: Mapping[str, int]
    bits: int
    inner_steps: int


@dataclass(frozen=True)
class RoundMeasurements:
    """Last round's numbers: ε per low-rank tensor, seconds spent sending, seconds computing;
    optionally the bytes each adapted tensor took in the message and the message's total, and
    the seconds the busiest receiver's downlink would take for every member's message (r_s in
    the module docstring)."""

    energy_kept: Mapping[str, float]
    send_seconds: float
    compute_seconds: float
    tensor_bytes: Mapping[str, int] = field(default_factory=dict)
    message_bytes: int = 0
    shared_send_seconds: float = 0.0
    growth_allowed: bool = True  # False: the last move up has not been measured yet

    def __post_init__(self) -> None:
        for name in ("send_seconds", "shared_send_seconds"):
            value = getattr(self, name)
            if not (_is_number(value) and value >= 0):
                raise ConfigurationError(f"{name} must be a finite number >= 0, got {value!r}.")
        if not (_is_number(self.compute_seconds) and self.compute_seconds > 0):
            raise ConfigurationError(
                f"compute_seconds must be a finite number > 0, got {self.compute_seconds!r}.")
        for name, energy in self.energy_kept.items():
            if not (_is_number(energy) and -1e-6 <= energy <= 1 + 1e-6):
                raise ConfigurationError(f"energy kept of {name!r} must be in [0, 1], got {energy!r}.")
        if self.tensor_bytes and not (_is_int(self.message_bytes) and all(
                _is_int(b) and b >= 0 for b in self.tensor_bytes.values())
                and sum(self.tensor_bytes.values()) <= self.message_bytes):
            raise ConfigurationError("tensor_bytes must be ints >= 0 whose sum is at most "
                                     f"message_bytes, got {sum(self.tensor_bytes.values())} "
                                     f"of {self.message_bytes!r}.")


@dataclass(frozen=True)
class SettingChange:
    """One setting that moved, and why."""

    setting: str  # "rank:<tensor>", "bits" or "inner_steps"
    old: int
    new: int
    reason: str

    @property
    def upward(self) -> bool:
        """More bytes a round: a higher rank or more bits, or a smaller H."""
        return self.new < self.old if self.setting == "inner_steps" else self.new > self.old


@dataclass(frozen=True)
class ControllerDecision:
    """The new settings and the record of the round's decision."""

    settings: CompressionSettings
    send_ratio: float               # send_seconds / compute_seconds of the measured round
    budget: str                     # "over", "within" or "slack"
    changes: tuple[SettingChange, ...] = ()
    held_back: tuple[str, ...] = field(default=())

    def summary(self) -> str:
        """One line for the round's log."""
        moves = ", ".join(f"{c.setting} {c.old}->{c.new}" for c in self.changes) or "no change"
        return (f"send/compute {self.send_ratio:.2f} ({self.budget}); {moves}; "
                f"bits {self.settings.bits}, H {self.settings.inner_steps}")


class AdaptiveController:
    """Applies the module's rules; holds only its configuration."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config if config is not None else ControllerConfig()

    def decide(self, settings: CompressionSettings, measurements: RoundMeasurements) -> ControllerDecision:
        """New settings from last round's settings and measurements (see the module docstring)."""
        self._check_bounds(settings)
        missing = sorted(set(measurements.energy_kept) - set(settings.ranks))
        if missing:
            raise ConfigurationError(f"energy was measured for tensors without a rank: {missing[:5]}.")
        config = self.config
        ranks, bits, steps = dict(settings.ranks), settings.bits, settings.inner_steps
        ratio = measurements.send_seconds / measurements.compute_seconds
        changes: list[SettingChange] = []
        held_back: list[str] = []

        if ratio > config.overlap_budget:
            budget = "over"
            reason = f"send took {ratio:.0%} of compute, over the {config.overlap_budget:.0%} budget"
            lowered = {n: self._lower_rank(k) for n, k in ranks.items() if k > config.min_rank}
            if lowered:
                changes += [SettingChange(f"rank:{n}", ranks[n], k, reason) for n, k in lowered.items()]
                ranks.update(lowered)
            elif bits > config.bits_choices[0]:
                new_bits = config.bits_choices[config.bits_choices.index(bits) - 1]
                changes.append(SettingChange("bits", bits, new_bits, reason + " at the rank floor"))
                bits = new_bits
            elif steps < config.max_inner_steps:
                new_steps = min(config.max_inner_steps,
                                max(steps + 1, math.ceil(steps * config.inner_steps_factor)))
                changes.append(SettingChange("inner_steps", steps, new_steps,
                                             reason + " at the rank and bits floors"))
                steps = new_steps
            else:
                held_back.append("over budget with rank, bits and H all at their bounds")
            return self._decision(ranks, bits, steps, ratio, budget, changes, held_back)

        budget = "slack" if ratio <= config.slack_ratio * config.overlap_budget else "within"
        held_to = max(ratio, measurements.shared_send_seconds / measurements.compute_seconds)

        def projected(new_ranks: Mapping[str, int], new_bits: int, new_steps: int) -> float:
            """r after a move (the module docstring's r')."""
            growth = _byte_growth(settings.ranks, new_ranks, measurements)
            return held_to * growth * (new_bits / settings.bits) * (settings.inner_steps / new_steps)

        def try_move(candidate: tuple[dict[str, int], int, int], move: str) -> bool:
            """Upward moves only: allowed while the projected ratio stays within budget."""
            if not measurements.growth_allowed:
                held_back.append(f"{move} held back: the last move up is still being measured")
                return False
            after = projected(*candidate)
            if after <= config.overlap_budget:
                return True
            held_back.append(f"{move} held back: projected send/compute {after:.2f} would exceed "
                             f"the budget {config.overlap_budget}")
            return False

        raises: dict[str, int] = {}
        for name, energy in sorted(measurements.energy_kept.items()):
            rank = ranks[name]
            if energy > config.energy_high and rank > config.min_rank:
                ranks[name] = self._lower_rank(rank)
                changes.append(SettingChange(f"rank:{name}", rank, ranks[name],
                                             f"energy kept {energy:.3f} is above {config.energy_high}"))
            elif energy < config.energy_target and rank < config.max_rank:
                raises[name] = self._raise_rank(rank)
        if raises and try_move(({**ranks, **raises}, bits, steps), f"rank raise of {sorted(raises)[:5]}"):
            for name, rank in raises.items():
                changes.append(SettingChange(
                    f"rank:{name}", ranks[name], rank,
                    f"energy kept {measurements.energy_kept[name]:.3f} is below {config.energy_target}"))
            ranks.update(raises)

        if budget == "slack":
            reason = f"send took {ratio:.0%} of compute, far under the {config.overlap_budget:.0%} budget"
            if steps > config.min_inner_steps:
                new_steps = max(config.min_inner_steps,
                                min(steps - 1, math.floor(steps / config.inner_steps_factor)))
                if try_move((ranks, bits, new_steps), f"H {steps}->{new_steps}"):
                    changes.append(SettingChange("inner_steps", steps, new_steps, reason))
                    steps = new_steps
            elif bits < config.bits_choices[-1]:
                new_bits = config.bits_choices[config.bits_choices.index(bits) + 1]
                if try_move((ranks, new_bits, steps), f"bits {bits}->{new_bits}"):
                    changes.append(SettingChange("bits", bits, new_bits, reason))
                    bits = new_bits
            else:
                touched = {c.setting.removeprefix("rank:") for c in changes}
                spend = {n: self._raise_rank(ranks[n]) for n, energy in measurements.energy_kept.items()
                         if n not in touched and ranks[n] < config.max_rank
                         and energy <= config.energy_high}
                move = f"rank raise of {sorted(spend)[:5]}"
                if spend and try_move(({**ranks, **spend}, bits, steps), move):
                    changes += [SettingChange(f"rank:{n}", ranks[n], k, reason) for n, k in spend.items()]
                    ranks.update(spend)
        return self._decision(ranks, bits, steps, ratio, budget, changes, held_back)

    # ------------------------------------------------------------------ helpers
    def _lower_rank(self, rank: int) -> int:
        return max(self.config.min_rank, min(rank - 1, math.floor(rank / self.config.rank_factor)))

    def _raise_rank(self, rank: int) -> int:
        return min(self.config.max_rank, max(rank + 1, math.ceil(rank * self.config.rank_factor)))

    def _check_bounds(self, settings: CompressionSettings) -> None:
        config = self.config
        for name, rank in settings.ranks.items():
            if not (_is_int(rank) and config.min_rank <= rank <= config.max_rank):
                raise ConfigurationError(f"rank of {name!r} = {rank!r} is outside "
                                         f"[{config.min_rank}, {config.max_rank}].")
        if settings.bits not in config.bits_choices:
            raise ConfigurationError(f"bits {settings.bits!r} is not one of {config.bits_choices}.")
        if not (_is_int(settings.inner_steps)
                and config.min_inner_steps <= settings.inner_steps <= config.max_inner_steps):
            raise ConfigurationError(f"inner steps {settings.inner_steps!r} is outside "
                                     f"[{config.min_inner_steps}, {config.max_inner_steps}].")

    @staticmethod
    def _decision(ranks: dict[str, int], bits: int, steps: int, ratio: float, budget: str,
                  changes: list[SettingChange], held_back: list[str]) -> ControllerDecision:
        return ControllerDecision(CompressionSettings(ranks, bits, steps), ratio, budget,
                                  tuple(changes), tuple(held_back))


def _byte_growth(ranks: Mapping[str, int], new_ranks: Mapping[str, int],
                 measured: RoundMeasurements) -> float:
    """The message's bytes after moving `ranks` to `new_ranks`, over its bytes now."""
    sizes, total = measured.tensor_bytes, measured.message_bytes
    if sizes and total and set(new_ranks) <= set(sizes):
        moved = sum(sizes[n] * new_ranks[n] / ranks[n] for n in new_ranks)
        return (total - sum(sizes[n] for n in new_ranks) + moved) / total
    before = sum(ranks.values())
    return sum(new_ranks.values()) / before if before else 1.0


def settings_of(codec: LowRankCodec | TopKCodec, names: list[str], inner_steps: int) -> CompressionSettings:
    """The codec's current settings for the tensors it adapts (by name): rank or k."""
    strength = codec.rank_of if isinstance(codec, LowRankCodec) else codec.k_of
    return CompressionSettings({name: strength(name) for name in names}, codec.bits, inner_steps)


def apply_settings(codec: LowRankCodec | TopKCodec, settings: CompressionSettings) -> None:
    """Give the codec the decided strengths and bits (H belongs to the trainer)."""
    codec.bits = settings.bits
    set_strength = codec.set_rank if isinstance(codec, LowRankCodec) else codec.set_k
    for name, strength in settings.ranks.items():
        set_strength(name, strength)


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
