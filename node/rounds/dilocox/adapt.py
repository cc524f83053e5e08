"""DiLoCoX's adaptive compression in a round: protocol/controller.py fed with the round's numbers.

After each round's message is encoded, the controller reads what it kept (ε per tensor, from
the sender's encoder, and the bytes each tensor took) and how long that message will take to
send against a round's compute (the link's `send_ratio`: the worst cost per byte of its last
few sends over the shortest of its last few rounds; 0 for the simulator's in-memory links,
which model no bandwidth), and, as a bound on moves up only, the busiest receiver's downlink
(`shared_ratio`: every member's message of this size, judged from how much longer our push
to it took than to the fastest receiver), and sets the codec's strength (top-k: k per tensor;
low-rank: rank) and bits for the next round.

Rules:
- before the link has measured a send (None: the daemon's first round) the settings are held:
  an unmeasured link is not a free one;
- after a move up exactly one decision holds (`measuring`): the message of the new size has
  just been handed over, and the decision after it reads that message's send, finished or
  still in flight (send_ratio counts a send in flight at its seconds so far); so no move up is
  decided on a size whose cost was never read, and no more than one decision is lost to it;
- the controller starts START_DOUBLINGS moves below the manifest's strength (the first rounds'
  messages are encoded before any send is measured); a link with room returns to the
  manifest's strength in as many measured moves up.
The runs behind these rules: benchmarks/NOTEBOOK.md, "Why DiLoCoX's rules are as they are".

Bounds come from the manifest, so every member can decode every other's messages: top-k's k up
to `max_density · topk_chunk` (the density a receiver accepts), its bits any of 2, 4, 8; low-rank
ranks 1-64, bits 4 or 8. H stays the manifest's: the daemon numbers rounds by step // H, so a
node that changed H alone would leave its swarm's rounds (the controller's H rule is bounded
to H = H). Each round's choice is returned as a plain dict, for metrics.jsonl, the status view
and telemetry.
"""

from __future__ import annotations

import math
from typing import Any

from node.config.manifest import ProtocolSection
from protocol.codecs import Codec, LowRankCodec, TopKCodec
from protocol.controller import AdaptiveController, CompressionSettings, ControllerConfig, \
    RoundMeasurements, apply_settings, settings_of
from protocol.dilocox import PseudoGradientMessage

LOWRANK_MAX_RANK = 64
START_DOUBLINGS = 2  # the start's strength: the manifest's over rank_factor to this power
MEASURE_ROUNDS = 1   # decisions held after a move up: the new size's send is measured by then


def controller_config(config: ProtocolSection, codec: Codec) -> ControllerConfig | None:
    """The controller's bounds for this manifest and codec; None for codecs it cannot adapt."""
    common = {"min_inner_steps": config.inner_steps, "max_inner_steps": config.inner_steps,
              "energy_target": config.controller_energy_target,
              "energy_high": config.controller_energy_high,
              "overlap_budget": config.controller_send_budget}
    if isinstance(codec, TopKCodec):
        return ControllerConfig(min_rank=1, max_rank=max(1, math.floor(config.max_density * codec.chunk)),
                                bits_choices=(2, 4, 8), **common)
    if isinstance(codec, LowRankCodec):
        return ControllerConfig(min_rank=1, max_rank=LOWRANK_MAX_RANK, bits_choices=(4, 8), **common)
    return None


class CompressionAdapter:
    """The controller and the codec it adapts, one decision per round."""

    def __init__(self, config: ProtocolSection, codec: Codec) -> None:
        bounds = controller_config(config, codec)
        if bounds is None:
            raise ValueError(f"protocol.controller needs the topk or lowrank codec, not {codec.name!r}")
        self.codec, self.inner_steps = codec, config.inner_steps
        self.controller = AdaptiveController(bounds)
        _start_below_the_manifest(codec, bounds)
        self.measuring = 0  # decisions until the last move up's new size is measured

    def after_send(self, message: PseudoGradientMessage, send_ratio: float | None,
                   shared_ratio: float = 0.0) -> dict[str, Any]:
        """Decide the next round's settings from this round's message; returns the record.
        `send_ratio` None: the link has not measured a send yet, and nothing changes.
        `shared_ratio`: the busiest receiver's downlink for every member's message (r_s)."""
        energy = {name: min(1.0, max(0.0, e)) for name, e in message.energy_kept.items()}
        bounds = self.controller.config
        settings = settings_of(self.codec, sorted(energy), self.inner_steps)
        if send_ratio is None:
            return self._record(settings, energy, send_ratio=None, shared_ratio=shared_ratio,
                                budget="unmeasured", changes=0,
                                summary="send/compute not measured yet: settings held")
        clamped = {n: min(max(k, bounds.min_rank), bounds.max_rank) for n, k in settings.ranks.items()}
        settings = type(settings)(clamped, settings.bits, settings.inner_steps)
        sizes = {name: message.tensors[name].size_bytes for name in energy}
        measured = RoundMeasurements(energy, send_seconds=send_ratio, compute_seconds=1.0,
                                     tensor_bytes=sizes, message_bytes=message.size_bytes,
                                     shared_send_seconds=shared_ratio,
                                     growth_allowed=self.measuring == 0)
        decision = self.controller.decide(settings, measured)
        apply_settings(self.codec, decision.settings)
        grew = any(change.upward for change in decision.changes)
        self.measuring = MEASURE_ROUNDS if grew else max(0, self.measuring - 1)
        return self._record(decision.settings, energy, send_ratio=send_ratio,
                            shared_ratio=shared_ratio, budget=decision.budget,
                            changes=len(decision.changes), summary=decision.summary())

    def _record(self, settings: CompressionSettings, energy: dict[str, float], *,
                send_ratio: float | None, shared_ratio: float, budget: str, changes: int,
                summary: str) -> dict[str, Any]:
        """The round's choice as metrics.jsonl, the status view and telemetry show it."""
        strengths = list(settings.ranks.values()) or [0]
        strength = "k" if isinstance(self.codec, TopKCodec) else "rank"
        return {"codec": self.codec.name, "bits": settings.bits,
                f"{strength}_min": min(strengths), f"{strength}_max": max(strengths),
                "energy_kept": sum(energy.values()) / len(energy) if energy else None,
                "send_ratio": send_ratio, "shared_ratio": shared_ratio, "budget": budget,
                "changes": changes, "summary": summary}


def _start_below_the_manifest(codec: LowRankCodec | TopKCodec, bounds: ControllerConfig) -> None:
    """Lower the codec's default strength (rank or k) START_DOUBLINGS moves, within the bounds."""
    attribute = "default_rank" if isinstance(codec, LowRankCodec) else "default_k"
    manifest = getattr(codec, attribute)
    start = max(bounds.min_rank, math.floor(manifest / bounds.rank_factor ** START_DOUBLINGS))
    setattr(codec, attribute, min(start, bounds.max_rank))
