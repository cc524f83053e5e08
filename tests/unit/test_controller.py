"""The adaptive controller (protocol/controller.py) with made-up measurements."""

from __future__ import annotations

import pytest
import torch

from protocol.codecs import LowRankCodec, TopKCodec
from protocol.controller import AdaptiveController, CompressionSettings, ControllerConfig, \
    RoundMeasurements, apply_settings, settings_of
from protocol.errors import ConfigurationError

CONFIG = ControllerConfig(min_rank=1, max_rank=32, bits_choices=(4, 8), min_inner_steps=100,
                          max_inner_steps=800, energy_target=0.8, energy_high=0.95,
                          overlap_budget=0.8, slack_ratio=0.5)
CONTROLLER = AdaptiveController(CONFIG)


def _decide(ranks: dict[str, int], energies: dict[str, float], send: float, compute: float = 10.0,
            bits: int = 8, steps: int = 100):
    return CONTROLLER.decide(CompressionSettings(ranks, bits, steps),
                             RoundMeasurements(energies, send, compute))


def test_low_energy_raises_rank_and_high_energy_lowers_it() -> None:
    decision = _decide({"a": 4, "b": 4, "c": 4}, {"a": 0.5, "b": 0.99, "c": 0.9}, send=5.0)
    assert decision.budget == "within"
    assert dict(decision.settings.ranks) == {"a": 8, "b": 2, "c": 4}
    reasons = {c.setting: c.reason for c in decision.changes}
    assert "below 0.8" in reasons["rank:a"] and "above 0.95" in reasons["rank:b"]
    assert "rank:c" not in reasons


def test_rank_raise_is_held_back_when_it_would_break_the_budget() -> None:
    decision = _decide({"a": 4, "b": 4}, {"a": 0.5, "b": 0.5}, send=7.0)  # r = 0.7, ×2 -> 1.4
    assert dict(decision.settings.ranks) == {"a": 4, "b": 4}
    assert decision.changes == () and "held back" in decision.held_back[0]


def test_over_budget_lowers_rank_first_then_bits_then_raises_h() -> None:
    decision = _decide({"a": 8, "b": 1}, {"a": 0.2, "b": 0.2}, send=9.0)
    assert decision.budget == "over" and dict(decision.settings.ranks) == {"a": 4, "b": 1}
    assert decision.settings.bits == 8 and decision.settings.inner_steps == 100
    at_rank_floor = _decide({"a": 1}, {"a": 0.2}, send=9.0)
    assert at_rank_floor.settings.bits == 4 and at_rank_floor.changes[0].setting == "bits"
    at_bits_floor = _decide({"a": 1}, {"a": 0.2}, send=9.0, bits=4)
    assert at_bits_floor.settings.inner_steps == 200
    assert "rank and bits floors" in at_bits_floor.changes[0].reason
    at_every_bound = _decide({"a": 1}, {"a": 0.2}, send=9.0, bits=4, steps=800)
    assert at_every_bound.changes == () and "all at their bounds" in at_every_bound.held_back[0]


def test_slack_undoes_retreats_in_reverse_order_then_spends_on_rank() -> None:
    undo_h = _decide({"a": 4}, {"a": 0.9}, send=1.0, bits=4, steps=400)
    assert undo_h.budget == "slack" and undo_h.settings.inner_steps == 200
    assert undo_h.settings.bits == 4
    undo_bits = _decide({"a": 4}, {"a": 0.9}, send=1.0, bits=4, steps=100)
    assert undo_bits.settings.bits == 8 and undo_bits.settings.inner_steps == 100
    spend = _decide({"a": 4, "b": 4, "c": 4}, {"a": 0.9, "b": 0.99}, send=1.0)
    assert dict(spend.settings.ranks) == {"a": 8, "b": 2, "c": 4}  # b kept well, c not measured
    assert "far under" in {c.setting: c.reason for c in spend.changes}["rank:a"]


def test_bounds_are_never_left() -> None:
    top = _decide({"a": 32}, {"a": 0.1}, send=0.5)
    assert top.settings.ranks["a"] == 32 and top.settings.bits == 8
    bottom = _decide({"a": 1}, {"a": 1.0}, send=5.0)
    assert bottom.settings.ranks["a"] == 1
    near_top = AdaptiveController(ControllerConfig(max_rank=6)).decide(
        CompressionSettings({"a": 5}, 8, 50), RoundMeasurements({"a": 0.1}, 0.1, 10.0))
    assert near_top.settings.ranks["a"] == 6
    with pytest.raises(ConfigurationError, match="outside"):
        _decide({"a": 64}, {"a": 0.5}, send=1.0)
    with pytest.raises(ConfigurationError, match="bits"):
        _decide({"a": 4}, {"a": 0.5}, send=1.0, bits=6)
    with pytest.raises(ConfigurationError, match="inner steps"):
        _decide({"a": 4}, {"a": 0.5}, send=1.0, steps=5000)
    with pytest.raises(ConfigurationError, match="without a rank"):
        _decide({"a": 4}, {"z": 0.5}, send=1.0)


def test_decision_record_reads_in_one_line() -> None:
    summary = _decide({"a": 8}, {"a": 0.2}, send=9.0).summary()
    assert summary == "send/compute 0.90 (over); rank:a 8->4; bits 8, H 100"


@pytest.mark.parametrize("kwargs, message", [
    ({"min_rank": 0}, "min_rank"), ({"min_rank": 9, "max_rank": 8}, "min_rank"),
    ({"bits_choices": (8, 4)}, "bits_choices"), ({"bits_choices": (3,)}, "bits_choices"),
    ({"min_inner_steps": 0}, "inner steps"), ({"energy_target": 0.99}, "energy_target"),
    ({"overlap_budget": 0.0}, "overlap_budget"), ({"slack_ratio": 1.0}, "slack_ratio"),
    ({"rank_factor": 1.0}, "rank_factor"),
])
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ControllerConfig(**kwargs)


@pytest.mark.parametrize("send, compute, energy", [(-1.0, 1.0, 0.5), (1.0, 0.0, 0.5),
                                                   (float("nan"), 1.0, 0.5), (1.0, 1.0, 1.5)])
def test_measurement_validation(send: float, compute: float, energy: float) -> None:
    with pytest.raises(ConfigurationError):
        RoundMeasurements({"a": energy}, send, compute)


def test_settings_travel_to_and_from_the_codec() -> None:
    codec = LowRankCodec(rank=4, bits=8)
    settings = settings_of(codec, ["w"], inner_steps=100)
    decision = CONTROLLER.decide(settings, RoundMeasurements({"w": 0.3}, 1.0, 10.0))
    apply_settings(codec, decision.settings)
    encoded = codec.encode(torch.randn(64, 64), "w")
    assert encoded.description["rank"] == 8 and codec.rank_of("w") == 8


def test_topk_strength_is_k_per_tensor() -> None:
    codec = TopKCodec(k=16, chunk=256, bits=2)
    settings = settings_of(codec, ["w"], inner_steps=100)
    assert settings.ranks == {"w": 16} and settings.bits == 2
    decision = AdaptiveController(ControllerConfig(
        min_rank=1, max_rank=64, bits_choices=(2, 4, 8), min_inner_steps=100,
        max_inner_steps=100)).decide(settings, RoundMeasurements({"w": 0.1}, 1.0, 10.0))
    apply_settings(codec, decision.settings)
    assert codec.encode(torch.randn(512), "w").description["k"] == 32


def test_a_raise_is_projected_on_the_bytes_each_tensor_takes_not_on_the_sum_of_ranks() -> None:
    """Raising a large tensor's rank doubles most of the message even where a small tensor's
    rank, already high, keeps the sum of ranks from doubling: projected on Σ ranks, the raise
    looked within budget, and the rank went 32-64-32 round after round on a saturated link."""
    settings = CompressionSettings({"embedding": 16, "bias": 32}, 8, 100)
    energies = {"embedding": 0.5, "bias": 0.9}  # only the embedding asks for more rank
    by_rank_sum = CONTROLLER.decide(settings, RoundMeasurements(energies, 5.0, 10.0))
    assert dict(by_rank_sum.settings.ranks) == {"embedding": 32, "bias": 32}  # (32+32)/48: 0.67
    by_bytes = CONTROLLER.decide(settings, RoundMeasurements(
        energies, 5.0, 10.0, tensor_bytes={"embedding": 9000, "bias": 100}, message_bytes=9500))
    assert dict(by_bytes.settings.ranks) == {"embedding": 16, "bias": 32}  # 0.5 · 1.95 > 0.8
    assert any("projected send/compute 0.97" in h for h in by_bytes.held_back), by_bytes.held_back


def test_tensor_bytes_beyond_the_message_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="tensor_bytes"):
        RoundMeasurements({"a": 0.5}, 1.0, 1.0, tensor_bytes={"a": 200}, message_bytes=100)


def test_a_busy_shared_receiver_holds_moves_up_but_never_forces_one_down() -> None:
    """R14: each fast sender's own send was slack (r = 0.16) and it doubled its message while the
    other two did, onto a slow member's downlink that then carried 18 s a 12 s round. r_s, that
    downlink's time for every member's message, holds the raise; it does not lower a rank
    the sender's own link carries (measured while pushes overlapped there, it counts them twice)."""
    settings = CompressionSettings({"a": 4}, 8, 100)
    alone = CONTROLLER.decide(settings, RoundMeasurements({"a": 0.5}, 1.6, 10.0))
    assert alone.budget == "slack" and alone.settings.ranks["a"] == 8
    shared = CONTROLLER.decide(settings, RoundMeasurements({"a": 0.5}, 1.6, 10.0, shared_send_seconds=6.0))
    assert shared.settings.ranks["a"] == 4 and "1.20" in shared.held_back[0]
    heavy = CONTROLLER.decide(settings, RoundMeasurements({"a": 0.9}, 1.6, 10.0, shared_send_seconds=60.0))
    assert heavy.budget == "slack" and heavy.settings.ranks["a"] == 4 and not heavy.changes
    with pytest.raises(ConfigurationError, match="shared_send_seconds"):
        RoundMeasurements({"a": 0.5}, 1.0, 1.0, shared_send_seconds=-1.0)


def test_no_move_up_while_the_last_is_being_measured() -> None:
    """R19: under a token bucket's burst a link costs nothing per byte, and three fast nodes read
    slack three rounds running and doubled their messages from 53 to 408 KiB onto it. A move down
    stays free."""
    settings = CompressionSettings({"a": 4}, 8, 100)
    held = CONTROLLER.decide(settings, RoundMeasurements({"a": 0.5}, 0.1, 10.0, growth_allowed=False))
    assert held.settings.ranks["a"] == 4 and "still being measured" in held.held_back[0]
    over = CONTROLLER.decide(settings, RoundMeasurements({"a": 0.5}, 9.0, 10.0, growth_allowed=False))
    assert over.settings.ranks["a"] == 2
    assert [c.upward for c in CONTROLLER.decide(settings, RoundMeasurements({"a": 0.5}, 0.1, 10.0)).changes] == [True]
