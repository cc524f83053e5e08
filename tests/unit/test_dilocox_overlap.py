"""DiLoCoX's eager overlap, decaying residual and median clipping (protocol/dilocox.py, issue 18)."""

from __future__ import annotations

import math
import random

import numpy
import pytest
import torch

from protocol.codecs import get_codec
from protocol.diloco import DiLoCoHyperParameters
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters, PseudoGradientMessage
from protocol.errors import ConfigurationError
from protocol.tensors import difference, squared_norm, weights_digest


def _model() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(64, 80, generator=generator), "norm": torch.randn(80, generator=generator)}


def _swarm(count: int, codec: str = "topk", **hyper) -> list[DiLoCoX]:
    params = {"topk": {"k": 8, "chunk": 256, "bits": 2}}.get(codec, {})
    hyper = DiLoCoXHyperParameters(**{"delay": 1, **hyper})
    return [DiLoCoX(_model(), get_codec(codec, **params), f"node-{i}", hyper) for i in range(count)]


def _round(nodes: list[DiLoCoX], round_index: int, generator: torch.Generator, shuffle: random.Random,
           scale: dict[str, float] | None = None) -> list[PseudoGradientMessage]:
    """Every node trains (a random move from its round start), compresses, and receives every
    other node's message in its own order; then every node takes its outer step."""
    messages = []
    for node in nodes:
        start = node.round_start_weights()
        factor = (scale or {}).get(node.node_id, 1.0)
        theta = {n: t - factor * 0.05 * torch.randn(t.shape, generator=generator) for n, t in start.items()}
        messages.append(node.compress(node.pseudo_gradient(theta), round_index))
    for node in nodes:
        for message in shuffle.sample(messages, len(messages)):
            if message.sender != node.node_id:
                node.receive(message)
    for node in nodes:
        node.outer_step(round_index)
    return messages


def test_eager_share_is_the_weight_own_work_will_have_in_the_outer_step() -> None:
    nesterov = DiLoCoHyperParameters(outer_lr=0.7, momentum=0.3)
    nodes = _swarm(4, overlap="eager", outer=nesterov)
    generator, shuffle = torch.Generator().manual_seed(1), random.Random(1)
    assert nodes[0].in_flight_share() == pytest.approx(0.7 * 1.3)  # no round applied yet: n = 1
    _round(nodes, 0, generator, shuffle)
    _round(nodes, 1, generator, shuffle)  # applies round 0: four senders
    assert nodes[0].in_flight_share() == pytest.approx(0.7 * 1.3 / 4)
    plain = _swarm(1, overlap="eager", outer=DiLoCoHyperParameters(outer_lr=1.0, momentum=0.0,
                                                                    nesterov=False))[0]
    plain._last_group_size = 8
    assert plain.in_flight_share() == pytest.approx(1 / 8)
    # where the next round starts: φ − e − λ·D(own message of the round in flight)
    node = nodes[0]
    own = node._in_flight[1]
    expected = difference(node.slow_weights, node.residual)
    for name, tensor in expected.items():
        tensor.sub_(own[name], alpha=node.in_flight_share())
    start = node.round_start_weights()
    for name in expected:
        assert torch.equal(start[name], expected[name])
    half = _swarm(1)[0]
    assert half.in_flight_share() == 0.5


@pytest.mark.parametrize("hyper", [{"overlap": "eager"}, {"overlap": "eager", "residual_decay": 0.95},
                                   {"overlap": "eager", "clip_to_median": True}])
def test_agreed_state_is_identical_and_every_message_applied_once(hyper: dict) -> None:
    nodes = _swarm(5, **hyper)
    generator, shuffle = torch.Generator().manual_seed(2), random.Random(2)
    rounds = 6
    for round_index in range(rounds):
        _round(nodes, round_index, generator, shuffle)
        assert len({weights_digest(node.slow_weights) for node in nodes}) == 1
        assert len({weights_digest(node.momentum) for node in nodes}) == 1
    for node in nodes:  # delay 1: rounds 0..rounds-2 applied, each message of each once
        assert node.counters.applied_messages == 5 * (rounds - 1)
        assert node.counters.applied_rounds == rounds - 1
        assert node.counters.duplicates == 0 and node.counters.late == 0


def test_residual_decay_forgets_geometrically() -> None:
    """e ← β·e + Δ − D(c): with a codec that sends (almost) nothing, e is Σ βʲ Δ."""
    node = _swarm(1, codec="topk", residual_decay=0.5)[0]
    node.codec.set_k("embed", 1)
    node.codec.set_k("norm", 1)
    deltas = [{n: torch.full_like(t, 1.0) for n, t in _model().items()} for _ in range(3)]
    for round_index, delta in enumerate(deltas):
        before = node.residual
        node.compress(delta, round_index)
        sent = node._in_flight[round_index]
        for name in delta:
            torch.testing.assert_close(node.residual[name], delta[name] + 0.5 * before[name] - sent[name])
    with pytest.raises(ConfigurationError, match="residual_decay"):
        DiLoCoXHyperParameters(residual_decay=0.0)


def test_median_clip_bounds_a_scaled_message_and_leaves_equal_ones_alone() -> None:
    """One sender of five multiplies its update by 100: clipped, φ moves about as far as with
    honest senders only; without clipping it moves ~20x further."""
    moves = {}
    for clip in (False, True):
        nodes = _swarm(5, codec="identity", clip_to_median=clip)
        generator, shuffle = torch.Generator().manual_seed(3), random.Random(3)
        before = nodes[0].slow_weights
        for round_index in range(2):
            _round(nodes, round_index, generator, shuffle, scale={"node-4": 100.0})
        after = nodes[0].slow_weights
        moves[clip] = sum(float((after[n] - before[n]).norm()) for n in after)
        assert len({weights_digest(node.slow_weights) for node in nodes}) == 1
    assert moves[False] > 10 * moves[True]
    assert nodes[0].counters.clipped >= 1
    # equal norms: nothing above the median, nothing scaled
    honest = _swarm(4, codec="identity", clip_to_median=True)
    _round(honest, 0, torch.Generator().manual_seed(4), random.Random(4))
    _round(honest, 1, torch.Generator().manual_seed(4), random.Random(4))
    assert honest[0].counters.clipped <= 2  # only those above the median


def _pairwise_by_hand(values: list[float]) -> float:
    """The order squared_norm promises, in NumPy scalars: fp32 squares, halves added pairwise."""
    values = [numpy.float32(v) * numpy.float32(v) for v in values]
    while len(values) > 1:
        values = values + [numpy.float32(0.0)] * (len(values) % 2)
        half = len(values) // 2
        values = [a + b for a, b in zip(values[:half], values[half:])]
    return float(values[0]) if values else 0.0


def test_the_median_clips_norm_is_summed_in_an_order_the_shapes_fix() -> None:
    """A clip factor from torch's sum() could differ in its last bit between two CPUs (its
    kernel picks the order for the vector width) and split φ; squared_norm's order depends on
    the shapes alone, checked here bitwise against the same order by hand."""
    generator = torch.Generator().manual_seed(5)
    tensors = {"w": torch.randn(4099, generator=generator) * 3, "b": torch.randn(7, 3, generator=generator),
               "one": torch.randn(1, generator=generator), "none": torch.zeros(0)}
    by_hand = sum(_pairwise_by_hand(t.reshape(-1).tolist()) for t in tensors.values())
    assert squared_norm(tensors) == by_hand
    assert squared_norm(tensors) == pytest.approx(math.fsum(v * v for t in tensors.values()
                                                            for v in t.reshape(-1).tolist()), rel=1e-5)
