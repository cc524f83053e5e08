"""The bound on a partner's θ (protocol/pull_bound.py), alone and in a NoLoCo round."""

from __future__ import annotations

import math

import pytest
import torch

from node.config.manifest import ContributionSection
from node.rounds.noloco.round import PartnerSnapshot
from node.rounds.wire_tensors import rounding_error_norm, to_wire
from protocol.noloco import NoLoCoHyperParameters, noloco_update, theta_only_snapshot
from protocol.pull_bound import PullBound, clip_towards, distance
from tests.round_parts import config, corpus  # noqa: F401 (fixtures)
from tests.round_parts import noloco, partner_of, received, train_round


def test_before_its_warmup_the_floor_is_the_reference():
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    for _ in range(2):
        assert bound.judge(1.5, floor=1.0).scale == 1.0  # within 2x: used as sent
    clipped = bound.judge(4.0, floor=1.0)
    assert not clipped.refused and clipped.reference == 1.0 and clipped.scale == pytest.approx(0.5)
    refused = bound.judge(5.01, floor=1.0)
    assert refused.refused and list(bound.accepted) == [1.5, 1.5, 4.0]  # refused: not remembered


def test_after_its_warmup_the_median_of_accepted_distances_is_the_reference():
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0, warmup=4)
    for d in (10.0, 12.0, 11.0, 9.0):  # warming up against f = 4: clipped, not refused
        assert not bound.judge(d, floor=4.0).refused
    assert bound.reference(floor=1.0) == pytest.approx(10.5)
    assert bound.reference(floor=20.0) == 20.0  # never below the floor
    assert bound.judge(40.0, floor=1.0).scale == pytest.approx(21.0 / 40.0)
    assert bound.judge(60.0, floor=1.0).refused


def test_a_minority_of_far_partners_does_not_move_the_reference():
    """Every third partner at the refusal edge: the median stays the honest partners'."""
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    for i in range(60):
        honest = 1.0 + 0.01 * (i % 7)
        m = bound.reference(floor=0.5)
        bound.judge(4.99 * m if i % 3 == 2 else honest, floor=0.5)
    assert bound.reference(floor=0.5) < 1.1


def test_clip_towards_lands_at_the_scaled_distance_and_leaves_its_input_alone():
    mine = {"w": torch.zeros(3), "b": torch.ones(2)}
    theirs = {"w": torch.tensor([3.0, 0.0, 4.0]), "b": torch.ones(2)}
    clipped = clip_towards(theirs, mine, 0.2)
    assert distance(clipped, mine) == pytest.approx(1.0)
    assert torch.equal(theirs["w"], torch.tensor([3.0, 0.0, 4.0]))
    assert PullBound(clip_ratio=0.0, refuse_ratio=5.0).enabled is False


def test_rounding_error_norm_follows_the_wire_dtype():
    theta = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(0))}
    norm = theta["w"].norm().item()
    assert rounding_error_norm(theta, "fp32") == 0.0
    assert rounding_error_norm(theta, "bf16") == pytest.approx(norm / 256)
    int8, int4 = rounding_error_norm(theta, "int8"), rounding_error_norm(theta, "int4")
    assert int4 == pytest.approx(int8 * 127 / 7) and 0.05 * norm < int4 < 0.5 * norm


def _round_with_partner(config, corpus, bad_theta):
    """A blocking round 0 whose partner sends `bad_theta(own θ, partner's θ)` in fp32."""
    policy, link, model = noloco(config, corpus, "blocking", wire_dtype="fp32")
    _, theirs = partner_of(config, corpus, 0)
    train_round(model, policy, 0)
    own = policy.outer.snapshot(model.named_parameters())
    sent = bad_theta(own.fast_weights(), theirs.fast_weights())
    link.waiting[0] = PartnerSnapshot("bad", 0, received(0, to_wire(sent, "fp32", "theta/")))
    phi, momentum = dict(policy.outer.slow_weights), dict(policy.outer.outer_momentum)
    return policy, link, own, sent, phi, momentum


def test_a_negated_theta_is_refused_as_too_far_and_counted(config, corpus):
    policy, link, own, _, phi, momentum = _round_with_partner(
        config, corpus, lambda mine, theirs: {n: -t for n, t in theirs.items()})
    outcome = policy.end_round(0)
    assert link.refusals == [("bad", "distance")] and outcome.local_update
    assert "more than 5x the median distance of its recent partners" in outcome.refused[0]
    local, _ = noloco_update(phi, momentum, [own], NoLoCoHyperParameters())
    assert all(torch.equal(policy.outer.slow_weights[n], t) for n, t in local.items())


def test_a_partner_between_the_bounds_is_clipped_and_moves_phi_by_at_most_the_bound(config, corpus):
    """θ_j at 3.5x the floor f = ‖Δ_i‖ (fp32: no rounding) is used as θ_i + (2f/d)(θ_j − θ_i):
    the pair's φ is the exact update on that θ, (β/2)·2f from the local update."""
    hyper, limits = NoLoCoHyperParameters(), ContributionSection()
    assert limits.pull_clip_ratio < 3.5 < limits.pull_refuse_ratio

    policy, link, model = noloco(config, corpus, "blocking", wire_dtype="fp32")
    train_round(model, policy, 0)
    own = policy.outer.snapshot(model.named_parameters())
    mine = own.fast_weights()
    floor = math.sqrt(sum(float(d.pow(2).sum()) for d in own.local_progress.values()))
    _, theirs = partner_of(config, corpus, 0)
    away = distance(theirs.fast_weights(), mine)
    sent = clip_towards(theirs.fast_weights(), mine, 3.5 * floor / away)  # here: a push out
    link.waiting[0] = PartnerSnapshot("far", 0, received(0, to_wire(sent, "fp32", "theta/")))
    phi, momentum = dict(policy.outer.slow_weights), dict(policy.outer.outer_momentum)
    outcome = policy.end_round(0)
    assert link.refusals == [] and outcome.partner == "far" and policy.pulls_clipped == 1
    d = distance(sent, mine)
    assert d == pytest.approx(3.5 * floor, rel=1e-5)
    clipped = clip_towards(sent, mine, limits.pull_clip_ratio * floor / d)
    want, _ = noloco_update(phi, momentum, [own, theta_only_snapshot(clipped, hyper)], hyper)
    local, _ = noloco_update(phi, momentum, [own], hyper)
    for name, t in want.items():
        assert torch.allclose(policy.outer.slow_weights[name], t, atol=1e-6)
    pull = distance(policy.outer.slow_weights, local)
    assert pull == pytest.approx(hyper.progress_weight / 2 * limits.pull_clip_ratio * floor, rel=1e-4)
