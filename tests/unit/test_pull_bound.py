"""The bound on a partner's θ (protocol/pull_bound.py), alone and in a NoLoCo round."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from node.config.manifest import ContributionSection
from node.rounds.noloco.round import PartnerSnapshot
from node.rounds.wire_tensors import (from_wire_quantized, rounding_error_along,
                                      rounding_error_norm, to_wire)
from protocol.noloco import NoLoCoHyperParameters, noloco_update, theta_only_snapshot
from protocol.pull_bound import PullBound, clip_towards, distance, radial
from tests.round_parts import config, corpus  # noqa: F401 (fixtures)
from tests.round_parts import noloco, partner_of, received, train_round


def test_before_two_other_partners_are_known_the_floor_is_the_reference_and_nobody_is_refused():
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    first = bound.judge("a", 9.0, floor=1.0)  # nobody else known: m = f, clipped at 2f, not refused
    assert first.reference == 1.0 and not first.refused and first.scale == pytest.approx(2.0 / 9.0)
    again = bound.judge("a", 90.0, floor=1.0)  # a two-node swarm: its only partner, far away
    assert not again.refused and again.scale == pytest.approx(2.0 / 90.0)
    second = bound.judge("b", 4.0, floor=1.0)  # one other partner: still f
    assert second.reference == 1.0 and not second.refused and second.scale == pytest.approx(0.5)
    third = bound.judge("c", 3.0, floor=1.0)  # two others: the lower median of {9, 4}
    assert third.reference == 4.0 and third.scale == 1.0
    assert bound.reference("a", floor=1.0) == 3.0  # lower median of {4, 3}
    assert bound.reference("a", floor=3.5) == 3.5  # never below the floor


def test_the_clip_and_refusal_thresholds_are_multiples_of_the_reference():
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    for k in range(4):
        bound.judge(f"h{k}", 2.0, floor=0.5)
    assert bound.judge("x", 4.0, floor=0.5).scale == 1.0  # exactly 2m: as sent
    assert bound.judge("x", 6.0, floor=0.5).scale == pytest.approx(4.0 / 6.0)
    at_edge = bound.judge("x", 10.0, floor=0.5)  # exactly 5m: clipped, not refused
    assert not at_edge.refused and at_edge.scale == pytest.approx(0.4)
    assert bound.judge("x", 10.01, floor=0.5).refused
    assert bound.judge("x", 10.01, floor=3.0).reference == 3.0


def test_every_judged_distance_is_its_partners_one_entry():
    """Refused and clipped distances are recorded, unclipped; judging a partner again replaces
    its entry; past `window` partners the one judged longest ago is forgotten."""
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0, window=3)
    bound.judge("h1", 1.0, floor=1.0)
    bound.judge("h2", 1.2, floor=1.0)
    assert bound.judge("bad", 100.0, floor=1.0).refused
    assert dict(bound.latest) == {"h1": 1.0, "h2": 1.2, "bad": 100.0}
    honest = bound.judge("h2", 1.3, floor=0.1)  # others {h1: 1, bad: 100}: the lower median is 1
    assert honest.reference == 1.0 and honest.scale == 1.0
    assert list(bound.latest) == ["h1", "bad", "h2"]
    bound.judge("h3", 1.1, floor=1.0)
    assert list(bound.latest) == ["bad", "h2", "h3"]


def test_a_partner_pairing_often_at_the_clip_cannot_widen_its_own_bound():
    """An attacker clipped at 4x the honest distances, pairing again and again, then at 6x:
    refused, as its clipped distances never join the reference it is judged by."""
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    bound.judge("h1", 1.0, floor=1.0)
    bound.judge("h2", 1.05, floor=1.0)
    for _ in range(8):
        clipped = bound.judge("bad", 4.0, floor=1.0)
        assert clipped.reference == 1.0 and clipped.scale == pytest.approx(0.5)
    assert bound.judge("bad", 6.0, floor=1.0).refused
    assert bound.judge("h1", 1.0, floor=1.0).scale == 1.0  # others {h2, bad}: m = 1.05


@settings(max_examples=200, deadline=None)
@given(others=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0.0, 1e3), max_size=8),
       own=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=30),
       floor=st.floats(0.0, 10.0))
def test_a_partners_own_distances_never_move_its_reference(others, own, floor):
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    for partner, d in others.items():
        bound.judge(partner, d, floor)
    m = bound.reference("j", floor)
    for d in own:
        assert bound.judge("j", d, floor).reference == m
        assert bound.reference("j", floor) == m


@settings(max_examples=300, deadline=None)
@given(data=st.data(), honest=st.integers(2, 8), bad=st.integers(0, 6))
def test_a_minority_of_partners_keeps_every_reference_within_the_honest_distances(
        data, honest, bad):
    """With the honest partners outnumbering the others by two, whatever the others send (near
    or far) and however often they pair, every partner's reference is an honest distance (once
    each has two others: before that it is f)."""
    assume(bad <= honest - 2 and honest + bad >= 3)
    partners = [f"h{k}" for k in range(honest)] + [f"x{k}" for k in range(bad)]
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    latest = {}  # each honest partner's latest distance
    # every partner judged once, then any of them in any order, any number of times
    for p in partners + data.draw(st.lists(st.sampled_from(partners), max_size=60)):
        d = data.draw(st.floats(1.0, 2.0) if p[0] == "h" else st.floats(0.0, 1e3))
        bound.judge(p, d, 0.5)
        if p[0] == "h":
            latest[p] = d
    for p in partners:
        assert min(latest.values()) <= bound.reference(p, floor=0.5) <= max(latest.values())


@settings(max_examples=300, deadline=None)
@given(data=st.data(), honest=st.integers(2, 8), bad=st.integers(1, 7))
def test_far_partners_fewer_than_the_honest_ones_never_raise_a_reference(data, honest, bad):
    """Partners further than every honest one (−θ, random weights, a push) leave every
    reference at most the largest honest distance while they are a minority."""
    assume(bad < honest)
    partners = [f"h{k}" for k in range(honest)] + [f"x{k}" for k in range(bad)]
    bound = PullBound(clip_ratio=2.0, refuse_ratio=5.0)
    latest = {}  # each honest partner's latest distance
    for p in partners + data.draw(st.lists(st.sampled_from(partners), max_size=60)):
        d = data.draw(st.floats(1.0, 2.0) if p[0] == "h" else st.floats(2.0, 1e3))
        bound.judge(p, d, 0.5)
        if p[0] == "h":
            latest[p] = d
    for p in partners:
        assert bound.reference(p, floor=0.5) <= max(latest.values())


def test_clip_towards_lands_at_the_scaled_distance_and_leaves_its_input_alone():
    mine = {"w": torch.zeros(3), "b": torch.ones(2)}
    theirs = {"w": torch.tensor([3.0, 0.0, 4.0]), "b": torch.ones(2)}
    clipped = clip_towards(theirs, mine, 0.2)
    assert distance(clipped, mine) == pytest.approx(1.0)
    assert torch.equal(theirs["w"], torch.tensor([3.0, 0.0, 4.0]))


def test_the_radial_part_sees_negation_replacement_and_zeroing_and_almost_none_of_the_rounding():
    """ρ: −θ is 2‖θ‖, random weights of each tensor's norm about ‖θ‖, a zeroed tensor its own
    norm; θ rounded to int4 lies rounding_error_norm away but within a few rounding_error_along
    of itself along its tensors (the rounding is independent between elements)."""
    g = torch.Generator().manual_seed(0)
    theta = {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g) * 0.1}
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in theta.values()))
    assert radial({n: -t for n, t in theta.items()}, theta) == pytest.approx(2 * norm)
    rand = {n: torch.randn(t.shape, generator=g) for n, t in theta.items()}
    rand = {n: r * (theta[n].norm() / r.norm()) for n, r in rand.items()}
    assert radial(rand, theta) == pytest.approx(norm, rel=0.05)
    zeroed = {"w": theta["w"], "b": torch.zeros(256)}
    assert radial(zeroed, theta) == pytest.approx(float(theta["b"].norm()))
    rounded = _int4(theta)
    off, along = distance(rounded, theta), radial(rounded, theta)
    assert off > 0.05 * norm  # the wire's rounding alone puts it this far away
    assert along < 4 * rounding_error_along(theta, "int4") < 0.01 * norm  # and not along itself


def _int4(theta: dict) -> dict:
    """θ as it arrives over an int4 wire, rounded stochastically."""
    sent = to_wire(theta, "int4", rounding=torch.Generator().manual_seed(1))
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    return from_wire_quantized(received(0, sent), "int4", shapes, [""])[""]


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
    policy.pull_bound.latest.update(h1=1.0, h2=1.0)  # two honest partners already judged
    outcome = policy.end_round(0)
    assert link.refusals == [("bad", "distance")] and outcome.local_update
    assert "more than 5x the median distance of its recent partners" in outcome.refused[0]
    local, _ = noloco_update(phi, momentum, [own], NoLoCoHyperParameters())
    assert all(torch.equal(policy.outer.slow_weights[n], t) for n, t in local.items())


def test_a_negated_theta_the_distance_would_only_clip_is_refused_on_its_radial_part(config, corpus):
    """With int4 θ two honest θs lie the wire's rounding apart, so the distance's reference can
    leave −θ within the refusal bound (here: clipped only); its part along the node's own
    tensors, 2‖θ_i‖, lies far beyond 5x the honest partners' (the rounding adds ~nothing there)."""
    policy, link, model = noloco(config, corpus, "blocking", wire_dtype="int4")
    _, theirs = partner_of(config, corpus, 0)
    train_round(model, policy, 0)
    mine = policy.outer.snapshot(model.named_parameters()).fast_weights()
    honest = _int4(theirs.fast_weights())
    sent = {n: -t for n, t in honest.items()}
    far = distance(sent, mine)
    policy.pull_bound.latest.update(h1=far / 4, h2=far / 4)  # the distance: clip, not refuse
    honest_radial = radial(honest, mine)
    policy.radial_bound.latest.update(h1=honest_radial, h2=honest_radial)
    assert radial(sent, mine) > 5 * honest_radial
    gen = torch.Generator().manual_seed(2)
    link.waiting[0] = PartnerSnapshot("bad", 0, received(0, to_wire(sent, "int4", "theta/", gen)))
    outcome = policy.end_round(0)
    assert link.refusals == [("bad", "distance")] and outcome.local_update
    assert "along this node's own tensors" in outcome.refused[0], outcome.refused


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


def test_a_first_partner_far_away_is_clipped_not_refused(config, corpus):
    """With no other partner judged yet (a swarm of two) the floors alone are no evidence against
    a partner: −θ is used clipped and nothing is counted against it. It is scaled by the smaller
    of 2f/d and 2f_ρ/ρ; for −θ the radial part binds (ρ = 2‖θ_i‖ where a round moves θ little
    along itself), so the pull is (β/2)·(2f_ρ/ρ)·d, below the distance's (β/2)·2f."""
    policy, link, own, sent, phi, momentum = _round_with_partner(
        config, corpus, lambda mine, theirs: {n: -t for n, t in theirs.items()})
    outcome = policy.end_round(0)
    assert link.refusals == [] and outcome.partner == "bad" and policy.pulls_clipped == 1
    local, _ = noloco_update(phi, momentum, [own], NoLoCoHyperParameters())
    mine = own.fast_weights()
    f = math.sqrt(sum(float(d.pow(2).sum()) for d in own.local_progress.values()))  # fp32
    f_radial = radial(phi, mine)
    d, rho = distance(sent, mine), radial(sent, mine)
    limits, hyper = ContributionSection(), NoLoCoHyperParameters()
    by_radial = limits.pull_clip_ratio * f_radial / rho
    assert by_radial < limits.pull_clip_ratio * f / d  # the radial part is the stricter
    pull = distance(policy.outer.slow_weights, local)
    assert pull == pytest.approx(hyper.progress_weight / 2 * by_radial * d, rel=1e-4)


def test_with_clip_ratio_0_the_bound_is_off_and_a_negated_theta_is_used(config, corpus):
    policy, link, own, sent, phi, momentum = _round_with_partner(
        config, corpus, lambda mine, theirs: {n: -t for n, t in theirs.items()})
    policy.pull_bound = PullBound(clip_ratio=0.0, refuse_ratio=5.0)
    assert not policy.pull_bound.enabled
    outcome = policy.end_round(0)
    assert link.refusals == [] and outcome.partner == "bad" and policy.pulls_clipped == 0
    hyper = NoLoCoHyperParameters()
    want, _ = noloco_update(phi, momentum, [own, theta_only_snapshot(sent, hyper)], hyper)
    for name, t in want.items():
        assert torch.allclose(policy.outer.slow_weights[name], t, atol=1e-6)
