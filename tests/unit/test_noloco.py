"""NoLoCo outer step (protocol/noloco.py) against docs/protocols.md §1."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.diloco import DiLoCo, DiLoCoHyperParameters
from protocol.errors import ConfigurationError, LayoutError
from protocol.noloco import (NoLoCo, NoLoCoHyperParameters, NoLoCoSnapshot, noloco_update,
                             theta_only_snapshot)


def _node(phi: list[float], delta: list[float]) -> NoLoCo:
    node = NoLoCo({"w": torch.tensor(phi)})
    node.load_state_dict({"slow_weights": {"w": torch.tensor(phi)},
                          "outer_momentum": {"w": torch.tensor(delta)}})
    return node


def test_official_test_vector_both_ranks() -> None:
    rank0 = _node([1, -2, 0.5], [0.2, -0.4, 0.1])
    rank1 = _node([3, 0, -1.5], [-0.3, 0.6, -0.2])
    snap0 = rank0.snapshot({"w": torch.tensor([0.6, -1, 0.25])})
    snap1 = rank1.snapshot({"w": torch.tensor([2.4, -0.5, -0.75])})
    phi0 = rank0.outer_step(snap0, [snap1])
    phi1 = rank1.outer_step(snap1, [snap0])
    torch.testing.assert_close(rank0.outer_momentum["w"], torch.tensor([0.45, 0.675, -0.475]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(phi0["w"], torch.tensor([1.45, -1.325, 0.025]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rank1.outer_momentum["w"], torch.tensor([-1.2, -0.225, 0.775]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(phi1["w"], torch.tensor([1.8, -0.225, -0.725]), atol=1e-6, rtol=0)


def test_late_pair_correction_after_a_local_update_equals_the_pair_update() -> None:
    """Overlap timing: the local update now and the pair's correction a round later land on the
    test vector's φ and δ, and shift θ by exactly what φ moved beyond the local update."""
    rank0, rank1 = _node([1, -2, 0.5], [0.2, -0.4, 0.1]), _node([3, 0, -1.5], [-0.3, 0.6, -0.2])
    snap0 = rank0.snapshot({"w": torch.tensor([0.6, -1, 0.25])})
    snap1 = rank1.snapshot({"w": torch.tensor([2.4, -0.5, -0.75])})
    local0, local1 = rank0.outer_step(snap0), rank1.outer_step(snap1)
    shift0 = rank0.late_pair_correction(snap0, [snap1])
    shift1 = rank1.late_pair_correction(snap1, [snap0])
    torch.testing.assert_close(rank0.outer_momentum["w"], torch.tensor([0.45, 0.675, -0.475]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(rank0.slow_weights["w"], torch.tensor([1.45, -1.325, 0.025]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(rank1.outer_momentum["w"], torch.tensor([-1.2, -0.225, 0.775]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(rank1.slow_weights["w"], torch.tensor([1.8, -0.225, -0.725]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(local0["w"] + shift0["w"], rank0.slow_weights["w"])
    torch.testing.assert_close(local1["w"] + shift1["w"], rank1.slow_weights["w"])
    assert not any(rank0.late_pair_correction(snap0, [])["w"])  # no partner: nothing to correct


VECTOR_AFTER = {0: ([0.45, 0.675, -0.475], [1.45, -1.325, 0.025]),
                1: ([-1.2, -0.225, 0.775], [1.8, -0.225, -0.725])}


@pytest.mark.parametrize("late", [False, True], ids=["outer_step", "late_pair_correction"])
def test_a_partner_known_by_theta_alone_gives_the_test_vector(late: bool) -> None:
    """β = γ: each rank applies the other's θ only (as (θ, 0)) and lands on the (φ, Δ) path's
    δ and φ to fp32 rounding, with the pair update taken at once or as the late correction."""
    ranks = [_node([1, -2, 0.5], [0.2, -0.4, 0.1]), _node([3, 0, -1.5], [-0.3, 0.6, -0.2])]
    thetas = [torch.tensor([0.6, -1, 0.25]), torch.tensor([2.4, -0.5, -0.75])]
    snaps = [node.snapshot({"w": theta}) for node, theta in zip(ranks, thetas)]
    for index, node in enumerate(ranks):
        other = snaps[1 - index]
        partner = theta_only_snapshot(other.fast_weights(), node.hyper)
        torch.testing.assert_close(partner.slow_weights["w"], thetas[1 - index], atol=1e-6, rtol=0)
        zero = partner.local_progress["w"]  # Δ = 0 holds one element, whatever the model's size
        assert zero.shape == (3,) and not zero.any() and zero.untyped_storage().nbytes() == 4
        if late:
            node.outer_step(snaps[index])
            node.late_pair_correction(snaps[index], [partner])
        else:
            node.outer_step(snaps[index], [partner])
        delta, phi = VECTOR_AFTER[index]
        torch.testing.assert_close(node.outer_momentum["w"], torch.tensor(delta), atol=1e-6, rtol=0)
        torch.testing.assert_close(node.slow_weights["w"], torch.tensor(phi), atol=1e-6, rtol=0)


def test_theta_alone_is_refused_when_beta_differs_from_gamma() -> None:
    hyper = NoLoCoHyperParameters(progress_weight=0.6, consensus_weight=0.7)
    with pytest.raises(ConfigurationError, match="protocol.snapshot = 'phi_delta'"):
        theta_only_snapshot({"w": torch.ones(3)}, hyper)


def test_alone_the_consensus_term_vanishes() -> None:
    node = _node([1.0, 2.0], [0.5, -0.5])
    own = node.snapshot({"w": torch.tensor([1.5, 1.0])})
    phi = node.outer_step(own)
    expected_delta = 0.5 * torch.tensor([0.5, -0.5]) + 0.7 * torch.tensor([0.5, -1.0])
    torch.testing.assert_close(node.outer_momentum["w"], expected_delta)
    torch.testing.assert_close(phi["w"], torch.tensor([1.0, 2.0]) + expected_delta)


def test_whole_swarm_group_is_diloco_heavy_ball() -> None:
    """G = all replicas, equal φ: δ ← α·δ + β·mean(θ − φ), φ ← φ + δ.

    Mapping: with DiLoCo's Δ_D = φ − θ = −Δ and torch heavy-ball SGD (nesterov=False),
    m ← μ·m + Δ̄_D ; φ ← φ − η·m. Put δ = −η·m: δ ← μ·δ + η·mean(θ − φ). So α = μ and β = η,
    and γ does not matter because φ_i − mean φ = 0 on every replica.
    """
    torch.manual_seed(0)
    hyper = NoLoCoHyperParameters()
    initial = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    replicas = [NoLoCo(initial, hyper) for _ in range(4)]
    reference = DiLoCo(initial, DiLoCoHyperParameters(outer_lr=hyper.progress_weight,
                                                      momentum=hyper.momentum, nesterov=False))
    for _ in range(6):
        thetas = [{n: t + 0.1 * torch.randn_like(t) for n, t in initial.items()} for _ in replicas]
        snapshots = [node.snapshot(theta) for node, theta in zip(replicas, thetas)]
        for index, node in enumerate(replicas):
            node.outer_step(snapshots[index], snapshots[:index] + snapshots[index + 1:])
        expected = reference.outer_step([reference.pseudo_gradient(theta) for theta in thetas])
        for node in replicas:
            for name in initial:
                torch.testing.assert_close(node.slow_weights[name], expected[name], atol=1e-6, rtol=0)
                torch.testing.assert_close(node.outer_momentum[name],
                                           -hyper.progress_weight * reference.momentum[name],
                                           atol=1e-6, rtol=0)


def test_group_of_three_matches_formula() -> None:
    torch.manual_seed(1)
    hyper = NoLoCoHyperParameters()
    phis = [torch.randn(6) for _ in range(3)]
    progress = [torch.randn(6) for _ in range(3)]
    momentum = torch.randn(6)
    group = [NoLoCoSnapshot({"x": p}, {"x": d}) for p, d in zip(phis, progress)]
    new_phi, new_delta = noloco_update({"x": phis[0]}, {"x": momentum}, group, hyper)
    delta = 0.5 * momentum + 0.7 * sum(progress) / 3 - 0.7 * (phis[0] - sum(phis) / 3)
    torch.testing.assert_close(new_delta["x"], delta)
    torch.testing.assert_close(new_phi["x"], phis[0] + delta)


def test_returned_weights_are_copies_and_state_round_trips() -> None:
    node = _node([1.0, 2.0], [0.1, 0.2])
    phi = node.outer_step(node.snapshot({"w": torch.tensor([1.1, 2.1])}))
    phi["w"].add_(100.0)  # training θ in place must not touch φ
    assert node.slow_weights["w"].abs().max() < 10
    clone = NoLoCo({"w": torch.zeros(2)})
    clone.load_state_dict(node.state_dict())
    assert torch.equal(clone.slow_weights["w"], node.slow_weights["w"])
    assert torch.equal(clone.outer_momentum["w"], node.outer_momentum["w"])


def test_snapshot_must_be_of_current_slow_weights() -> None:
    node = _node([1.0, 2.0], [0.0, 0.0])
    stale = node.snapshot({"w": torch.tensor([1.5, 2.5])})
    node.outer_step(stale)
    with pytest.raises(LayoutError, match="own snapshot"):
        node.outer_step(stale)


def test_layout_mismatch_is_refused() -> None:
    node = NoLoCo({"w": torch.zeros(3)})
    own = node.snapshot({"w": torch.ones(3)})
    with pytest.raises(LayoutError, match="shape"):
        node.outer_step(own, [NoLoCoSnapshot({"w": torch.zeros(4)}, {"w": torch.zeros(4)})])
    with pytest.raises(LayoutError, match="names"):
        node.snapshot({"v": torch.ones(3)})


@pytest.mark.parametrize("kwargs, message", [
    ({"momentum": 1.0}, "momentum α must be in"),
    ({"momentum": -0.1}, "momentum α must be in"),
    ({"progress_weight": 0.0}, "progress_weight β must be > 0"),
    ({"consensus_weight": -1.0}, "consensus_weight γ must be >= 0"),
    ({"momentum": float("nan")}, "finite number"),
    ({"progress_weight": "0.7"}, "finite number"),
    ({"consensus_weight": 0.4}, "unstable for pairs"),        # γ <= α
    ({"consensus_weight": 1.6}, "unstable for pairs"),        # γ >= √(2 + 0.25) = 1.5
])
def test_hyper_parameter_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        NoLoCoHyperParameters(**kwargs)


def test_unstable_can_be_allowed_with_a_warning() -> None:
    with pytest.warns(RuntimeWarning, match="unstable"):
        hyper = NoLoCoHyperParameters(consensus_weight=0.2, allow_unstable=True)
    assert hyper.pair_stability_problem() is not None
    assert NoLoCoHyperParameters().pair_stability_problem() is None
    assert math.isclose(NoLoCoHyperParameters(consensus_weight=1.49).consensus_weight, 1.49)
