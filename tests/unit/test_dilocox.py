"""DiLoCoX (protocol/dilocox.py) against docs/protocols.md §3."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from protocol.codecs import CodecError, Encoded, get_codec
from protocol.diloco import DiLoCo
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters, PseudoGradientMessage, ReceiveOutcome
from protocol.errors import ConfigurationError, LayoutError, ProtocolError
from protocol.vote import split_winner, winning_digest


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
        thetas = [_train(node.round_start_weights(), generator) for node in nodes]
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


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("codec, params", [("identity", {}),
                                           ("lowrank", {"rank": 1, "bits": 4, "min_elements": 64})])
def test_a_node_never_drops_nor_repeats_its_own_progress(codec: str, params: dict, delay: int) -> None:
    """Alone, with η = 1 and no momentum, the outer step hands back exactly what the node sent,
    so whatever the delay and however lossy the codec, each round starts where the previous
    one ended (w holds what φ lacks: the round in flight and the compression residual)."""
    from protocol.diloco import DiLoCoHyperParameters
    plain = DiLoCoXHyperParameters(DiLoCoHyperParameters(1.0, 0.0, nesterov=False), delay=delay,
                                   in_flight_weight=1.0)
    alone = DiLoCoX(_model(), get_codec(codec, **params), "alone", plain)
    generator = torch.Generator().manual_seed(7)
    for round_index in range(4):
        theta = _train(alone.round_start_weights(), generator)
        alone.compress(alone.pseudo_gradient(theta), round_index)
        alone.outer_step(round_index)
        start = alone.round_start_weights()
        assert all(torch.allclose(start[n], theta[n], atol=1e-5) for n in theta)
    # w = e + own messages in flight
    in_flight = alone.pending_rounds()
    assert list(in_flight) == ([3] if delay else [])


def test_the_round_in_flight_is_kept_until_applied_and_a_rejoin_forgets_it() -> None:
    generator = torch.Generator().manual_seed(8)
    nodes = _swarm("identity", 2, delay=1)
    deltas = [node.pseudo_gradient(_train(node.round_start_weights(), generator)) for node in nodes]
    _exchange(nodes, [n.compress(d, 0) for n, d in zip(nodes, deltas)], random.Random(7))
    for node, delta in zip(nodes, deltas):
        node.outer_step(0)  # nothing due yet: φ unchanged, the own round is in flight at λ = ½
        start, phi = node.round_start_weights(), node.slow_weights
        assert all(torch.allclose(start[n], phi[n] - delta[n] / 2) for n in phi)
        node.adopt_outer_state(node.outer_state(), rejoin=True)  # a rejoin forgets it
        assert all(torch.equal(node.round_start_weights()[n], phi[n]) for n in phi)
        assert node.node_id not in node.pending_rounds().get(0, ())


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


@pytest.mark.parametrize("hyper", [{}, {"clip_to_median": True}, {"noise_ratio": 0.1}])
def test_a_step_replayed_over_the_majoritys_messages_gives_the_majoritys_state_bitwise(hyper) -> None:
    """Node 3 missed node 0's message: its step applied the others' only and its φ left theirs.
    Replaying that step from its state before it over the majority's messages gives their φ
    and m bitwise (median clipping and the noise filter included), leaving its own state as
    it was; its own step's messages give its own state back."""
    nodes = [DiLoCoX(_model(), get_codec("lowrank", rank=2, min_elements=64), f"node-{i}",
                     DiLoCoXHyperParameters(delay=0, **hyper)) for i in range(4)]
    generator = torch.Generator().manual_seed(5)
    for node in nodes:  # a round, so that m is not zero
        node.outer_step(0)
    before = nodes[3].outer_state()
    messages = [node.compress(node.pseudo_gradient(_train(node.slow_weights, generator)), 1)
                for node in nodes]
    for node in nodes:
        for message in messages:
            if message.sender != node.node_id and (node.node_id, message.sender) != ("node-3", "node-0"):
                node.receive(message)
    states = [node.outer_step(1) for node in nodes]
    assert any(not torch.equal(states[3][n], states[0][n]) for n in states[0])
    theirs, ours = nodes[0].last_messages, nodes[3].last_messages
    assert sorted(theirs) == [f"node-{i}" for i in range(4)] and "node-0" not in ours
    replayed = nodes[3].replay(before, theirs)
    for group, held in (("slow_weights", nodes[0].slow_weights), ("momentum", nodes[0].momentum)):
        assert all(torch.equal(replayed[group][n], held[n]) for n in held), group
    assert all(torch.equal(nodes[3].slow_weights[n], states[3][n]) for n in states[3])  # untouched
    again = nodes[3].replay(before, ours)
    assert all(torch.equal(again["slow_weights"][n], states[3][n]) for n in states[3])


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
            assert torch.equal(original.round_start_weights()[name], copy.round_start_weights()[name])
            assert torch.equal(original.residual[name], copy.residual[name])
    with pytest.raises(ConfigurationError, match="codec 'lowrank'"):
        _swarm("identity", 1, delay=1)[0].load_state_dict(nodes[0].state_dict())


def _linear_swarm_error(in_flight_weight: float, converged: float, noise: float, rounds: int = 60,
                        nodes: int = 8) -> float:
    """DiLoCoX (the real class, identity codec, delay 1) on a linear model: each inner phase
    moves θ a fraction `converged` of the way to the optimum 0, plus per-node noise. Returns the
    mean squared distance of the nodes' start weights to 0 over the last 20 rounds."""
    from protocol.diloco import DiLoCoHyperParameters
    hyper = DiLoCoXHyperParameters(DiLoCoHyperParameters(0.7, 0.3), delay=1,
                                   in_flight_weight=in_flight_weight)
    swarm = [DiLoCoX({"x": torch.ones(1)}, get_codec("identity"), f"n{i}", hyper) for i in range(nodes)]
    generator = torch.Generator().manual_seed(0)
    squared = []
    for round_index in range(rounds):
        starts = [node.round_start_weights() for node in swarm]
        thetas = [{"x": s["x"] * (1 - converged) + noise * torch.randn(1, generator=generator)}
                  for s in starts]
        messages = [n.compress(n.pseudo_gradient(t), round_index) for n, t in zip(swarm, thetas)]
        for node in swarm:
            for message in messages:
                if message.sender != node.node_id:
                    node.receive(message)
            node.outer_step(round_index)
        squared.append(sum(float(n.round_start_weights()["x"]) ** 2 for n in swarm) / nodes)
    return sum(squared[-20:]) / 20


@pytest.mark.parametrize("converged", [0.3, 0.7, 1.0])
def test_half_weight_in_flight_keeps_the_delayed_iteration_stable(converged: float) -> None:
    """Why λ = ½ (module docstring): on a linear model it converges without noise and stays
    near the noise floor with it, where λ = 1 lets noise build up in fully converged directions."""
    assert _linear_swarm_error(0.5, converged, noise=0.0) < 1e-6
    half = _linear_swarm_error(0.5, converged, noise=0.1)
    assert half < 0.05
    if converged == 1.0:
        assert _linear_swarm_error(1.0, converged, noise=0.1) > 3 * half


def test_every_node_settles_a_tied_vote_on_the_same_digest():
    # two survivors that applied different messages vote 1:1; each must pick the same φ,
    # whatever order it counted the votes in, or the split would never heal
    assert winning_digest(Counter({"bb": 1, "aa": 1})) == winning_digest({"aa": 1, "bb": 1}) == "aa"
    assert winning_digest({"aa": 1, "bb": 2, "cc": 2}) == "bb"    # a majority beats the tie rule
    assert winning_digest({"ff": 3, "00": 1}) == "ff"


def test_a_total_split_goes_to_the_holder_ranked_first_for_the_round_whatever_the_digests():
    holders = {"aa": ["p1"], "bb": ["p2"], "cc": ["p3"], "dd": ["p4"]}
    winner = split_winner(holders, 7)
    # the same from any order of the votes, and a digest ground small changes nothing
    assert split_winner(dict(reversed(holders.items())), 7) == winner
    ground = {("00" if d != winner else d): p for d, p in holders.items()}
    assert split_winner(ground, 7) == winner
    # the rank changes with the round: no holder wins every split
    winners = {split_winner(holders, r) for r in range(40)}
    assert winners == set(holders)
