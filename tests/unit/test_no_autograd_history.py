"""protocol/ never keeps autograd history (the invariant in protocol/tensors.py).

The daemon hands the outer protocols its live parameters, which require grad. Before the fix a
NoLoCo node's Δ carried a graph into δ and φ, which then grew by a few autograd nodes per tensor
every round: the largest growing allocation in the soak's daemons. Each test runs rounds on
`torch.nn.Parameter` fast weights and looks at every tensor the protocol object keeps.
"""

from __future__ import annotations

import torch

from protocol.codecs import get_codec
from protocol.diloco import DiLoCo
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters
from protocol.noloco import NoLoCo
from protocol.tensors import difference, mean


def _live_parameters(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.nn.Parameter]:
    """What the daemon's trainer gives: parameters that require grad, moved by 'training'."""
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(t - 0.05 * torch.randn(t.shape, generator=generator)) for n, t in base.items()}


def _kept_tensors(value: object, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor reachable from `value` through attributes, dicts, lists and tuples."""
    if depth > 6:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    elif hasattr(value, "__dict__") and type(value).__module__.startswith("protocol"):
        children = list(vars(value).values())
    else:
        return []
    return [t for child in children for t in _kept_tensors(child, depth + 1)]


def _assert_no_history(owner: object) -> None:
    tensors = _kept_tensors(owner)
    assert tensors, "found no tensors: the walk no longer reaches the protocol's state"
    with_history = [tuple(t.shape) for t in tensors if t.requires_grad or t.grad_fn is not None]
    assert not with_history, f"{type(owner).__name__} keeps tensors with autograd history: {with_history}"


_MODEL = {"w": torch.ones(6, 4), "b": torch.zeros(4)}


def test_noloco_state_has_no_autograd_history_after_rounds_on_live_parameters() -> None:
    nodes = [NoLoCo(_MODEL), NoLoCo(_MODEL)]
    for round_index in range(3):
        snapshots = [node.snapshot(_live_parameters(node.slow_weights, 2 * round_index + i))
                     for i, node in enumerate(nodes)]
        for snapshot in snapshots:
            _assert_no_history(snapshot)
        for i, node in enumerate(nodes):
            phi = node.outer_step(snapshots[i], [snapshots[1 - i]])
            assert not any(t.requires_grad for t in phi.values())
            _assert_no_history(node)


def test_diloco_state_has_no_autograd_history_after_rounds_on_live_parameters() -> None:
    node = DiLoCo(_MODEL)
    for round_index in range(3):
        delta = node.pseudo_gradient(_live_parameters(node.slow_weights, round_index))
        assert not any(t.requires_grad for t in delta.values())
        node.outer_step([delta])
        _assert_no_history(node)


def test_dilocox_state_has_no_autograd_history_after_rounds_on_live_parameters() -> None:
    node = DiLoCoX(_MODEL, get_codec("lowrank", rank=1, bits=8), "node-0", DiLoCoXHyperParameters(delay=1))
    for round_index in range(3):
        delta = node.pseudo_gradient(_live_parameters(node.round_start_weights(), round_index))
        assert not any(t.requires_grad for t in delta.values())
        node.compress(delta, round_index)
        node.outer_step(round_index)
        _assert_no_history(node)


def test_shared_helpers_detach_what_they_read() -> None:
    live = _live_parameters(_MODEL, 0)
    assert not any(t.requires_grad for t in difference(live, _MODEL).values())
    assert not any(t.requires_grad for t in difference(_MODEL, live).values())
    assert not any(t.requires_grad for t in mean([_MODEL, live]).values())
