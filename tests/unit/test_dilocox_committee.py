"""DiLoCoX with a committee of senders (protocol/committee.py): who sends, what a member that
sits a round out keeps, and how the outer step weighs messages that carry several rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node.rounds.dilocox.payload import ROUNDS, decode_message, encode_message
from node.simulator.exchange import InMemoryMessage
from p2p.messages import OutgoingTensor
from protocol.codecs import get_codec
from protocol.committee import draw, send_share, sends
from protocol.diloco import DiLoCoHyperParameters
from protocol.dilocox import MAX_ROUNDS_CARRIED, DiLoCoX, DiLoCoXHyperParameters, \
    PseudoGradientMessage
from protocol.errors import ConfigurationError, ProtocolError
from protocol.tensors import weights_digest

PLAIN = DiLoCoHyperParameters(1.0, 0.0, nesterov=False)  # φ ← φ − Δ̄: the step is the mean itself


def _model() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(16, 8, generator=generator), "b": torch.randn(8, generator=generator)}


def _delta(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: 0.1 * torch.randn(t.shape, generator=generator) for n, t in _model().items()}


def test_the_committee_is_the_same_everywhere_and_about_k_members_send_a_round() -> None:
    assert send_share(8, 64) == send_share(8, 33) == 1 / 8  # sizes round up to a power of two
    assert send_share(8, 32) == 1 / 4 and send_share(8, 8) == send_share(8, 3) == 1.0
    assert send_share(0, 1000) == 1.0  # no committee: everyone sends
    with pytest.raises(ConfigurationError):
        send_share(-1, 8)
    assert draw("peer-a", 7) == draw("peer-a", 7) != draw("peer-a", 8)
    members = [f"peer-{i}" for i in range(64)]
    counts = [sum(sends(m, r, send_share(8, 64)) for m in members) for r in range(400)]
    assert 7.5 < np.mean(counts) < 8.5, np.mean(counts)
    # each member's turn comes round: none sits out for long
    gaps = [max(np.diff([-1] + [r for r in range(400) if sends(m, r, 1 / 8)] + [400]))
            for m in members]
    assert max(gaps) < MAX_ROUNDS_CARRIED, max(gaps)


def test_with_a_tenure_a_member_drawn_sends_that_many_rounds_in_a_row() -> None:
    members = [f"peer-{i}" for i in range(64)]
    for member in members:
        turns = [sends(member, r, 1 / 8, tenure=4) for r in range(400)]
        assert all(turns[r] == turns[r - r % 4] for r in range(400))
        assert turns == [sends(member, r // 4, 1 / 8) for r in range(400)]
    counts = [sum(sends(m, r, 1 / 8, tenure=4) for m in members) for r in range(400)]
    assert 7.5 < np.mean(counts) < 8.5, np.mean(counts)


def test_with_kept_decay_1_a_member_sat_out_sends_all_its_rounds_later() -> None:
    """Delay 0, identity codec, φ ← φ − Δ̄, β_k = 1: member a sits rounds 0 and 1 out and sends
    in round 2 a message of its three rounds; b sends every round. Round 2's step is
    (c_a + c_b) / 4, the rounds the two messages carry: each round of a's work weighs what b's
    one round does."""
    hyper = DiLoCoXHyperParameters(PLAIN, delay=0, kept_decay=1.0)
    a, b = (DiLoCoX(_model(), get_codec("identity"), name, hyper) for name in ("a", "b"))
    kept = {n: torch.zeros_like(t) for n, t in _model().items()}
    for round_index in range(2):
        delta_a = _delta(round_index)
        a.keep(delta_a, round_index)
        kept = {n: kept[n] + delta_a[n] for n in kept}
        # a's weights hold its kept work at the weight it will have in φ's step (here all of it)
        assert a.own_share() == 1.0
        assert all(torch.allclose(a.round_start_weights()[n], a.slow_weights[n] - kept[n]) for n in kept)
        message_b = b.compress(_delta(10 + round_index), round_index)
        assert message_b.rounds == 1
        a.receive(message_b)
        for node in (a, b):
            node.outer_step(round_index)
        assert weights_digest(a.slow_weights) == weights_digest(b.slow_weights)
    before = a.slow_weights
    message_a = a.compress(_delta(2), 2)
    message_b = b.compress(_delta(12), 2)
    assert (message_a.rounds, message_b.rounds) == (3, 1)
    a.receive(message_b)
    b.receive(message_a)
    phi_a, phi_b = a.outer_step(2), b.outer_step(2)
    assert weights_digest(phi_a) == weights_digest(phi_b)
    carried = {n: kept[n] + _delta(2)[n] for n in kept}  # what a's message holds, exactly
    for name in before:
        expected = before[name] - (carried[name] + _delta(12)[name]) / 4
        assert torch.allclose(phi_a[name], expected, atol=1e-6)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in a.residual.values())  # all of it sent
    assert a.own_share() == 1 / 4  # the rounds the last step carried


def test_by_default_a_member_sat_out_sends_its_fresh_round_alone() -> None:
    """β_k = 0 (the default): what waited outside the committee is stale by the time it could be
    sent, and is not; the message says the rounds it waited, but weighs one round. With
    β_k = 0.5 a message of 3 rounds weighs 1 + 0.5 + 0.25."""
    hyper = DiLoCoXHyperParameters(PLAIN, delay=0)
    assert hyper.kept_decay == 0 and hyper.carried_weight(3) == 1.0
    assert DiLoCoXHyperParameters(kept_decay=0.5).carried_weight(3) == 1.75
    a, b = (DiLoCoX(_model(), get_codec("identity"), name, hyper) for name in ("a", "b"))
    for round_index in range(2):
        a.keep(_delta(round_index), round_index)
        a.receive(b.compress(_delta(10 + round_index), round_index))
        a.outer_step(round_index)
        b.outer_step(round_index)
    before = a.slow_weights
    message_a = a.compress(_delta(2), 2)
    assert message_a.rounds == 3
    assert all(torch.equal(a.codec.decode(e.description, e.payload), _delta(2)[n])
               for n, e in message_a.tensors.items())
    a.receive(b.compress(_delta(12), 2))
    phi = a.outer_step(2)
    for name in before:
        assert torch.allclose(phi[name], before[name] - (_delta(2)[name] + _delta(12)[name]) / 2,
                              atol=1e-6)


def test_the_rounds_kept_count_in_a_members_weights_at_their_share_of_the_step() -> None:
    """η = 0.5 and 4 rounds carried by the last step: a member's kept round counts at 1/8 in the
    weights it trains (it would count the swarm's common progress twice at weight 1)."""
    hyper = DiLoCoXHyperParameters(DiLoCoHyperParameters(0.5, 0.0, nesterov=False), delay=0,
                                   kept_decay=1.0)
    node = DiLoCoX(_model(), get_codec("identity"), "a", hyper)
    tensors = {n: node.codec.encode(t, n) for n, t in _delta(1).items()}
    node.receive(PseudoGradientMessage("p", 0, tensors, 4))
    node.keep(_delta(0), 0)
    node.outer_step(0)
    assert node.own_share() == 0.5 / 4
    start, phi = node.round_start_weights(), node.slow_weights
    assert all(torch.allclose(start[n], phi[n] - _delta(0)[n] / 8) for n in phi)


def test_with_kept_decay_1_and_a_lossy_codec_what_sat_out_is_sent_later_and_nothing_is_lost() -> None:
    node = DiLoCoX(_model(), get_codec("lowrank", rank=1, bits=8, min_elements=64), "a",
                   DiLoCoXHyperParameters(PLAIN, delay=0, kept_decay=1.0))
    inputs = {n: torch.zeros_like(t) for n, t in _model().items()}
    sent = {n: torch.zeros_like(t) for n, t in inputs.items()}
    for round_index in range(30):
        delta = _delta(round_index)
        inputs = {n: inputs[n] + delta[n] for n in inputs}
        if round_index % 3 == 2:
            message = node.compress(delta, round_index)
            assert message.rounds == 3
            for name, encoded in message.tensors.items():
                sent[name] += node.codec.decode(encoded.description, encoded.payload)
        else:
            node.keep(delta, round_index)
        node.outer_step(round_index)
    for name in inputs:
        assert torch.allclose(sent[name] + node.residual[name], inputs[name], atol=1e-5)


def test_a_round_sat_out_turns_the_encoders_warm_start_on_what_it_would_have_sent() -> None:
    """keep() tracks Δ + β_k·k + β·e: after rounds sat out, the encoder stands where a member
    that sent every round would (its residual aside), not at its last send's subspace."""
    lowrank = dict(rank=1, bits=8, min_elements=64)
    hyper = DiLoCoXHyperParameters(PLAIN, delay=0)
    member = DiLoCoX(_model(), get_codec("lowrank", **lowrank), "a", hyper)
    reference = get_codec("lowrank", **lowrank)
    message = member.compress(_delta(0), 0)
    reference.encode(_delta(0)["w"], "w")
    residual = member.residual["w"]
    member.outer_step(0)
    member.keep(_delta(1), 1)
    reference.encode(_delta(1)["w"] + residual, "w")
    assert torch.equal(member.codec.state_dict()["warm_start"]["w"],
                       reference.state_dict()["warm_start"]["w"])
    assert message.rounds == 1 and member.residual["w"].equal(residual)  # e waits for the next send


def test_median_clipping_compares_norms_per_round_carried() -> None:
    """A message carrying 4 rounds may be 4 times the median one-round message's norm, not more."""
    hyper = DiLoCoXHyperParameters(PLAIN, delay=0, clip_to_median=True, kept_decay=1.0)
    node = DiLoCoX(_model(), get_codec("identity"), "me", hyper)
    unit = _delta(1)
    encode = lambda scale: {n: node.codec.encode(scale * t, n) for n, t in unit.items()}  # noqa: E731
    for sender, scale, rounds in (("p", 1.0, 1), ("q", 1.0, 1), ("r", 4.0, 4)):
        node.receive(PseudoGradientMessage(sender, 0, encode(scale), rounds))
    node.outer_step(0)
    assert node.counters.clipped == 0
    for sender, scale, rounds in (("p", 1.0, 1), ("q", 1.0, 1), ("r", 8.0, 4)):
        node.receive(PseudoGradientMessage(sender, 1, encode(scale), rounds))
    node.outer_step(1)
    assert node.counters.clipped == 1


@pytest.mark.parametrize("rounds", [0, -1, MAX_ROUNDS_CARRIED + 1, 2.0])
def test_a_message_claiming_rounds_out_of_bounds_is_refused(rounds) -> None:
    node = DiLoCoX(_model(), get_codec("identity"), "me", DiLoCoXHyperParameters(PLAIN))
    tensors = {n: node.codec.encode(t, n) for n, t in _delta(1).items()}
    with pytest.raises(ProtocolError, match="rounds of work"):
        node.receive(PseudoGradientMessage("p", 0, tensors, rounds))
    assert node.pending_rounds() == {}


def _wire(message: PseudoGradientMessage, extra: list[OutgoingTensor] = ()) -> InMemoryMessage:
    return InMemoryMessage(message.round_index, [*encode_message(message), *extra])


def test_the_rounds_a_message_carries_travel_with_it_and_a_bad_field_is_refused() -> None:
    codec = get_codec("identity")
    tensors = {n: codec.encode(t, n) for n, t in _delta(1).items()}
    one, three = (PseudoGradientMessage("p", 5, tensors, r) for r in (1, 3))
    assert ROUNDS not in {t.name for t in encode_message(one)}  # the usual case costs no bytes
    assert decode_message("p", 5, _wire(one)).rounds == 1
    assert decode_message("p", 5, _wire(three)).rounds == 3
    for bad in (OutgoingTensor(ROUNDS, "int32", (1,), np.array([999], dtype=np.int32)),
                OutgoingTensor(ROUNDS, "int64", (1,), np.array([2], dtype=np.int64)),
                OutgoingTensor(ROUNDS, "int32", (2,), np.array([2, 2], dtype=np.int32))):
        with pytest.raises(ValueError, match="rounds"):
            decode_message("p", 5, _wire(one, [bad]))


def test_a_checkpoint_keeps_the_rounds_sat_out_and_those_pending_messages_carry() -> None:
    hyper = DiLoCoXHyperParameters(PLAIN, delay=1)
    node = DiLoCoX(_model(), get_codec("identity"), "me", hyper)
    node.keep(_delta(0), 0)
    node.outer_step(0)
    tensors = {n: node.codec.encode(t, n) for n, t in _delta(1).items()}
    node.receive(PseudoGradientMessage("p", 1, tensors, 5))
    restored = DiLoCoX(_model(), get_codec("identity"), "me", hyper)
    restored.load_state_dict(node.state_dict())
    assert restored.compress(_delta(1), 1).rounds == node.compress(_delta(1), 1).rounds == 2
    node.outer_step(2)
    restored.outer_step(2)
    assert weights_digest(node.slow_weights) == weights_digest(restored.slow_weights)
    assert node.last_step.senders == ("me", "p")


def test_a_simulated_swarm_with_a_committee_agrees_every_round_and_sends_a_quarter() -> None:
    """8 replicas, about 2 senders a round (the daemon's round class, node/simulator): one φ on
    every replica after every round, and about a quarter of the bytes of everyone sending."""
    from node.config.schema import load_config
    from node.data.corpus import load_corpus
    from node.simulator import SimulationSettings
    from node.simulator.runner import Simulation
    from tests.unit.test_simulator import VERY_SMALL

    config = load_config(overrides=VERY_SMALL)
    corpus = load_corpus(config.data)
    results = {}
    for senders in (0, 2):
        settings = SimulationSettings("dilocox", workers=8, inner_steps=4, rounds=8, codec="lowrank",
                                      rank=2, latency_steps=1, protocol_values={
                                          "senders": senders, "apply_on_arrival": True})
        simulation = Simulation(settings, config, corpus)
        applied = []
        result = simulation.run(lambda record: applied.append(
            simulation.method.rounds["replica-0"].outer.last_step.senders))
        assert all(record.phi_digests == 1 for record in result.records), senders
        assert result.final.resyncs == 0
        results[senders] = (result.final.bytes_sent_per_replica, applied)
    everyone, committee = results[0][0], results[2][0]
    assert 0.1 < committee / everyone < 0.5, (committee, everyone)
    assert all(len(senders) == 8 for senders in results[0][1][1:])
    assert max(len(senders) for senders in results[2][1]) < 8
