"""DiLoCo outer Nesterov step (protocol/diloco.py) against docs/protocols.md §2."""

from __future__ import annotations

import pytest
import torch

from protocol.diloco import DiLoCo, DiLoCoHyperParameters
from protocol.errors import ConfigurationError, LayoutError


def test_matches_the_written_formula_over_rounds() -> None:
    torch.manual_seed(0)
    initial = {"w": torch.randn(7), "m": torch.randn(2, 3)}
    node = DiLoCo(initial)
    eta, mu = 0.7, 0.9
    phi = {n: t.clone() for n, t in initial.items()}
    momentum = {n: torch.zeros_like(t) for n, t in initial.items()}
    for _ in range(5):
        thetas = [{n: t - 0.05 * torch.randn_like(t) for n, t in phi.items()} for _ in range(3)]
        new_phi = node.outer_step([node.pseudo_gradient(theta) for theta in thetas])
        for name in phi:
            mean_delta = sum(phi[name] - theta[name] for theta in thetas) / 3
            momentum[name] = mu * momentum[name] + mean_delta
            phi[name] = phi[name] - eta * (mean_delta + mu * momentum[name])
            torch.testing.assert_close(new_phi[name], phi[name], atol=1e-6, rtol=0)
            torch.testing.assert_close(node.momentum[name], momentum[name], atol=1e-6, rtol=0)


def test_the_step_has_the_bits_of_the_formula_one_rounding_at_a_time() -> None:
    """DiLoCoX nodes agree on φ bitwise, on whatever CPU or GPU: the step must round each product
    and each sum once, as numpy's elementwise fp32 arithmetic does anywhere. torch's SGD fuses
    `a + α·b` where its kernels vectorize (its bits changed with ATEN_CPU_CAPABILITY on one
    machine), so this fails on an SGD-based step."""
    import numpy as np
    rs = np.random.RandomState(4)
    phi0 = rs.standard_normal(10_007).astype(np.float32)
    deltas = [rs.standard_normal(10_007).astype(np.float32) * np.float32(0.01) for _ in range(4)]
    for nesterov, mu in ((True, 0.6), (False, 0.5)):
        node = DiLoCo({"w": torch.from_numpy(phi0.copy())},
                      DiLoCoHyperParameters(outer_lr=0.7, momentum=mu, nesterov=nesterov))
        phi, m = phi0.copy(), np.zeros_like(phi0)
        eta, mu32 = np.float32(0.7), np.float32(mu)
        for delta in deltas:
            m = m * mu32 + delta
            phi = phi - (m * mu32 + delta if nesterov else m) * eta
            got = node.apply_mean({"w": torch.from_numpy(delta)})["w"]
            assert torch.equal(got, torch.from_numpy(phi)) and torch.equal(node.momentum["w"],
                                                                           torch.from_numpy(m))


def test_state_dict_round_trip_continues_identically() -> None:
    torch.manual_seed(2)
    initial = {"w": torch.randn(5)}
    first, deltas = DiLoCo(initial), [{"w": torch.randn(5)} for _ in range(4)]
    first.apply_mean(deltas[0])
    restored = DiLoCo({"w": torch.zeros(5)})
    restored.load_state_dict(first.state_dict())
    for delta in deltas[1:]:
        assert torch.equal(first.apply_mean(delta)["w"], restored.apply_mean(delta)["w"])


def test_fresh_state_round_trip_steps_like_torch_first_step() -> None:
    node, restored = DiLoCo({"w": torch.ones(3)}), DiLoCo({"w": torch.zeros(3)})
    restored.load_state_dict(node.state_dict())
    delta = {"w": torch.tensor([0.1, -0.2, 0.3])}
    assert torch.equal(node.apply_mean(delta)["w"], restored.apply_mean(delta)["w"])


def test_bad_inputs_are_refused() -> None:
    node = DiLoCo({"w": torch.zeros(3)})
    with pytest.raises(LayoutError, match="shape"):
        node.apply_mean({"w": torch.zeros(4)})
    with pytest.raises(LayoutError, match="at least one"):
        node.outer_step([])
    with pytest.raises(LayoutError, match="no tensors"):
        DiLoCo({})
    with pytest.raises(ConfigurationError, match="momentum"):
        DiLoCoHyperParameters(momentum=1.5)
    with pytest.raises(ConfigurationError, match="outer_lr"):
        DiLoCoHyperParameters(outer_lr=0.0)
