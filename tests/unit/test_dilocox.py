"""DiLoCoX (protocol/dilocox.py) against PROTOCOLS.md §3."""

from __future__ import annotations

import random

import pytest
import torch

from protocol.codecs import CodecError, Encoded, get_codec
from protocol.diloco import DiLoCo
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters, PseudoGradientMessage, ReceiveOutcome
from protocol.errors import ConfigurationError, LayoutError, ProtocolError


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(40, 24, generator=generator), "norm": torch.randn(24, generator=generator),
            "proj": torch.randn(24, 3, 4, generator=generator)}


def _train(weights: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A stand-in for H inner steps: a random move of θ away from φ."""
    return {n: t - 0.05 * torch.randn(t.shape, generator=generator) for n, t in weights.items()}


def _swarm(codec: str, count: int, delay: int, **params) -> list[DiLoCoX]:
    hyper = DiLoCoXHyperParameters(delay=delay)
    return [DiLoCoX(_model(), get_codec(codec, **params), f"node-{i}", hyper) for i in range(count)]


def _exchange(nodes: list[DiLoCoX], messages: list[PseudoGradientMessage], shuffle: random.Random) -> None:
    """Deliver every message to every other node, in a different order per node."""
    for node in nodes:
        for message in shuffle.sample(messages, len(messages)):
            if message.sender != node.node_id:
                assert node.receive(message) is ReceiveOutcome.ACCEPTED


def test_identity_codec_with_no_delay_is_exactly_diloco() -> None:
    nodes, reference = _swarm("identity", 4, delay=0), DiLoCo(_model())
    generator, shuffle = torch.Generator().manual_seed(1), random.Random(1)
    for round_index in range(5):
        thetas = [_train(node.slow_weights, generator) for node in nodes]
        messages = [node.compress(node.pseudo_gradient(theta), round_index)
                    for node, theta in zip(nodes, thetas)]
        _exchange(nodes, messages, shuffle)
        expected = reference.outer_step([reference.pseudo_gradient(theta) for theta in thetas])
        for node in nodes:
            phi = node.outer_step(round_index)
            for name in expected:
                assert torch.equal(phi[name], expected[name])
                assert torch.equal(node.momentum[name], reference.momentum[name])
                assert torch.equal(node.residual[name], torch.zeros_like(expected[name]))


def test_one_step_delay_applies_the_previous_rounds_mean() -> None:
    nodes, reference = _swarm("identity", 3, delay=1), DiLoCo(_model())
    generator, shuffle = torch.Generator().manual_seed(2), random.Random(2)
    previous_deltas = None
    for round_index in range(4):
        thetas = [_train(node.slow_weights, generator) for node in nodes]
        deltas = [node.pseudo_gradient(theta) for node, theta in zip(nodes, thetas)]
        messages = [node.compress(delta, round_index) for node, delta in zip(nodes, deltas)]
        _exchange(nodes, messages, shuffle)
        expected = reference.slow_weights if previous_deltas is None else \
            reference.outer_step(previous_deltas)
        for node in nodes:
            phi = node.outer_step(round_index)
            assert node.last_step.applied_round == (None if round_index == 0 else round_index - 1)
            assert all(torch.equal(phi[n], expected[n]) for n in expected)
        previous_deltas = deltas


@pytest.mark.parametrize("codec, params", [("lowrank", {"rank": 2, "bits": 8, "min_elements": 64}),
                                           ("lowrank", {"rank": 1, "bits": 4, "min_elements": 64}),
                                           ("blockwise", {"bits": 4, "block_size": 64})])
def test_error_feedback_loses_nothing(codec: str, params: dict) -> None:
    node = _swarm(codec, 1, delay=0, **params)[0]
    generator = torch.Generator().manual_seed(3)
    inputs = {n: torch.zeros_like(t) for n, t in _model().items()}
    sent = {n: torch.zeros_like(t) for n, t in inputs.items()}
    for round_index in range(60):
        delta = {n: torch.randn(t.shape, generator=generator) for n, t in inputs.items()}
        message = node.compress(delta, round_index)
        for name, encoded in message.tensors.items():
            inputs[name] += delta[name]
            sent[name] += node.codec.decode(encoded.description, encoded.payload)
        node.outer_step(round_index)
    residual = node.residual
    for name in inputs:
        gap = (sent[name] + residual[name] - inputs[name]).norm() / inputs[name].norm()
        print(f"\n{codec} {params} {name}: relative gap {float(gap):.2e}, "
              f"residual/input norm {float(residual[name].norm() / inputs[name].norm()):.3f}")
        assert gap < 1e-5, (name, float(gap))


def test_lowrank_swarm_keeps_identical_weights_whatever_the_arrival_order() -> None:
    nodes = _swarm("lowrank", 3, delay=1, rank=2, min_elements=64)
    generator, shuffle = torch.Generator().manual_seed(4), random.Random(4)
    for round_index in range(4):
        messages = [node.compress(node.pseudo_gradient(_train(node.slow_weights, generator)),
                                  round_index) for node in nodes]
        assert all(message.energy_kept.keys() == {"embed", "proj"} for message in messages)
        _exchange(nodes, messages, shuffle)
        weights = [node.outer_step(round_index) for node in nodes]
        for other in weights[1:]:
            assert all(torch.equal(other[n], weights[0][n]) for n in other)


def test_every_message_is_applied_exactly_once() -> None:
    sender, receiver = _swarm("blockwise", 2, delay=1, bits=8)
    zero = {n: torch.zeros_like(t) for n, t in _model().items()}
    first = sender.compress(zero, 0)
    assert receiver.receive(first) is ReceiveOutcome.ACCEPTED
    assert receiver.receive(first) is ReceiveOutcome.DUPLICATE
    receiver.compress(zero, 0)
    receiver.outer_step(0)                                   # delay 1: nothing due yet
    assert receiver.pending_rounds() == {0: ("node-0", "node-1")}
    receiver.outer_step(1)                                   # applies round 0
    assert receiver.last_step.senders == ("node-0", "node-1")
    assert receiver.receive(first) is ReceiveOutcome.LATE    # its round is applied
    far = PseudoGradientMessage("node-0", 50, first.tensors)
    assert receiver.receive(far) is ReceiveOutcome.TOO_EARLY
    receiver.outer_step(2)                                   # round 1: no messages at all
    counters = receiver.counters
    assert (counters.accepted, counters.duplicates, counters.late, counters.too_early) == (2, 1, 1, 1)
    assert (counters.applied_messages, counters.applied_rounds, counters.empty_rounds) == (2, 1, 1)
    assert receiver.pending_rounds() == {}
    with pytest.raises(ProtocolError, match="already applied"):
        receiver.outer_step(2)


def test_a_skipped_round_drops_its_messages_and_counts_them() -> None:
    sender, receiver = _swarm("identity", 2, delay=0)
    zero = {n: torch.zeros_like(t) for n, t in _model().items()}
    receiver.receive(sender.compress(zero, 0))
    receiver.receive(sender.compress(zero, 1))
    receiver.outer_step(1)                                   # round 0 never applied
    assert receiver.counters.late == 1 and receiver.last_step.senders == ("node-0",)


def test_compress_once_per_round() -> None:
    node = _swarm("identity", 1, delay=0)[0]
    zero = {n: torch.zeros_like(t) for n, t in _model().items()}
    node.compress(zero, 0)
    with pytest.raises(ProtocolError, match="above the last compressed round"):
        node.compress(zero, 0)
    node.outer_step(0)
    with pytest.raises(LayoutError, match="names"):
        node.compress({"embed": zero["embed"]}, 1)


def test_malformed_messages_are_refused_and_not_held() -> None:
    sender, receiver = _swarm("blockwise", 2, delay=0, bits=8)
    good = sender.compress({n: torch.randn(t.shape) for n, t in _model().items()}, 0)
    missing = PseudoGradientMessage("node-0", 0, {n: e for n, e in good.tensors.items() if n != "norm"})
    with pytest.raises(LayoutError, match="tensor names"):
        receiver.receive(missing)
    reshaped = dict(good.tensors)
    description = dict(reshaped["norm"].description, shape=[4, 6])
    reshaped["norm"] = Encoded(description, reshaped["norm"].payload)
    with pytest.raises(LayoutError, match="expected \\(24,\\)"):
        receiver.receive(PseudoGradientMessage("node-0", 0, reshaped))
    corrupted = dict(good.tensors)
    corrupted["norm"] = Encoded(corrupted["norm"].description, corrupted["norm"].payload[:-1])
    with pytest.raises(CodecError, match="payload is"):
        receiver.receive(PseudoGradientMessage("node-0", 0, corrupted))
    with pytest.raises(ProtocolError, match="sender"):
        receiver.receive(PseudoGradientMessage("", 0, good.tensors))
    assert receiver.pending_rounds() == {} and receiver.receive(good) is ReceiveOutcome.ACCEPTED


def test_state_dict_round_trip_resumes_identically() -> None:
    nodes = _swarm("lowrank", 2, delay=1, rank=2, min_elements=64)
    generator = torch.Generator().manual_seed(5)
    thetas = [[_train(_model(), generator) for _ in nodes] for _ in range(3)]

    def play(players: list[DiLoCoX], rounds: range) -> None:
        for round_index in rounds:
            messages = [p.compress(p.pseudo_gradient(thetas[round_index][i]), round_index)
                        for i, p in enumerate(players)]
            for p in players:
                for m in messages:
                    if m.sender != p.node_id:
                        p.receive(m)
                p.outer_step(round_index)

    play(nodes, range(2))
    restored = _swarm("lowrank", 2, delay=1, rank=2, min_elements=64)
    for original, copy in zip(nodes, restored):
        copy.load_state_dict(original.state_dict())
        assert copy.pending_rounds() == original.pending_rounds()
    play(nodes, range(2, 3))
    play(restored, range(2, 3))
    for original, copy in zip(nodes, restored):
        for name, tensor in original.slow_weights.items():
            assert torch.equal(tensor, copy.slow_weights[name])
            assert torch.equal(original.residual[name], copy.residual[name])
    with pytest.raises(ConfigurationError, match="codec 'lowrank'"):
        _swarm("identity", 1, delay=1)[0].load_state_dict(nodes[0].state_dict())
