"""The plausible-noise check (node/rounds/noise_check.py) and its use by NoLoCo's round."""

import dataclasses
import math

import pytest
import torch

from node.config.manifest import ContributionSection
from node.config.schema import ConfigError, build_section
from node.rounds.contributions import ContributionRefused
from node.rounds.noise_check import NoiseCheck
from node.rounds.noloco import payload as noloco_payload
from node.rounds.noloco.round import PartnerSnapshot
from protocol.structure import magnitude_score
from tests.round_parts import config, corpus  # noqa: F401 (fixtures)
from tests.round_parts import noloco, partner_of, received, train_round


def structured(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Progress with a per-coordinate scale, as an inner optimizer gives: some coordinates move
    much more than others, the same ones on every replica."""
    scale = {"w": torch.linspace(0.01, 1.0, 64 * 64).reshape(64, 64) ** 3, "b": torch.linspace(0, 1, 64)}
    return {n: s * torch.randn(s.shape, generator=generator) for n, s in scale.items()}


def noise_of_the_same_norms(x: dict, generator: torch.Generator) -> dict:
    out = {}
    for n, t in x.items():
        z = torch.randn(t.shape, generator=generator)
        out[n] = z * (t.norm() / z.norm())
    return out


def cosine(a: dict, b: dict) -> float:
    dot = sum(float((a[n] * b[n]).sum()) for n in a)
    return dot / math.sqrt(sum(float(a[n].square().sum()) for n in a) *
                           sum(float(b[n].square().sum()) for n in b))


def test_uncorrelated_honest_progress_scores_high_and_noise_of_its_norm_within_the_noise():
    g = torch.Generator().manual_seed(0)
    own, theirs = structured(g), structured(g)
    assert abs(cosine(own, theirs)) < 0.05  # directions as unrelated as at a plateau
    honest, elements = magnitude_score(theirs, own)
    noise, _ = magnitude_score(noise_of_the_same_norms(theirs, g), own)
    assert elements == 64 * 64 + 64
    assert honest > 0.3 and abs(noise) < 5 / math.sqrt(elements)


def test_the_bar_is_the_noise_floor_then_a_share_of_the_swarms_recent_median():
    g = torch.Generator().manual_seed(1)
    check, own = NoiseCheck(0.5, window=8, warmup=3), structured(g)
    elements = 64 * 64 + 64
    assert check.bar(elements) == pytest.approx(5 / math.sqrt(elements))
    scores = [check.check("honest", structured(g), own, "a snapshot") for _ in range(3)]
    assert check.bar(elements) == pytest.approx(0.5 * sorted(scores)[1])
    with pytest.raises(ContributionRefused) as refused:
        check.check("liar", noise_of_the_same_norms(structured(g), g), own, "NoLoCo snapshot")
    assert refused.value.reason == "noise"
    assert str(refused.value).startswith("NoLoCo snapshot from liar looks like noise")
    assert list(check.accepted) == scores  # a refused score does not move the bar


def test_a_reference_of_zeros_judges_nothing_and_a_ratio_of_zero_is_off():
    g = torch.Generator().manual_seed(2)
    zeros = {n: torch.zeros_like(t) for n, t in structured(g).items()}
    check = NoiseCheck(0.5)
    check.check("p", noise_of_the_same_norms(structured(g), g), zeros, "x")  # no refusal
    assert not NoiseCheck(0.0).enabled and check.enabled


def test_the_manifest_key_is_validated():
    with pytest.raises(ConfigError, match="contributions.noise_ratio"):
        build_section(ContributionSection, {"noise_ratio": 1.5}, "contributions.")
    assert ContributionSection().noise_ratio == 0.1


def test_noloco_refuses_a_phi_delta_snapshot_of_noise_and_applies_an_honest_one(config, corpus):  # noqa: F811
    for honest in (True, False):
        policy, link, model = noloco(config, corpus, "blocking", snapshot="phi_delta")
        partner, theirs = partner_of(config, corpus, 0, layout="phi_delta")
        if not honest:
            g = torch.Generator().manual_seed(3)
            theirs = dataclasses.replace(theirs, local_progress=noise_of_the_same_norms(
                theirs.local_progress, g))
            partner = PartnerSnapshot("bad", 0, received(0, noloco_payload.encode_snapshot(
                theirs, "fp32", "phi_delta")))
        link.waiting[0] = partner
        train_round(model, policy, 0)
        outcome = policy.end_round(0)
        if honest:
            assert outcome.partner == "partner" and link.refusals == []
        else:
            assert outcome.local_update and link.refusals == [("bad", "noise")]
            assert "looks like noise" in outcome.refused[0]


def test_with_theta_snapshots_noloco_does_not_apply_the_noise_check(config, corpus):  # noqa: F811
    policy, link, model = noloco(config, corpus, "blocking")
    partner, theirs = partner_of(config, corpus, 0)
    theirs = dataclasses.replace(theirs, local_progress=noise_of_the_same_norms(
        theirs.local_progress, torch.Generator().manual_seed(3)))
    link.waiting[0] = PartnerSnapshot("bad", 0, received(0, noloco_payload.encode_snapshot(
        theirs, "fp32", "theta")))
    train_round(model, policy, 0)
    assert policy.end_round(0).partner == "bad" and link.refusals == []


def test_dilocox_leaves_the_noise_sender_out_on_every_node_alike():
    from protocol.codecs import get_codec
    from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters
    from tests.unit.test_dilocox import _model

    shapes = {n: t.shape for n, t in _model().items()}
    g = torch.Generator().manual_seed(4)
    scale = {n: torch.rand(s, generator=g) ** 4 for n, s in shapes.items()}  # shared by honest nodes

    def run(ratio: float) -> list[DiLoCoX]:
        hyper = DiLoCoXHyperParameters(delay=0, noise_ratio=ratio)
        nodes = [DiLoCoX(_model(), get_codec("identity"), f"node-{i}", hyper) for i in range(4)]
        gen = torch.Generator().manual_seed(5)
        deltas = [{n: scale[n] * torch.randn(s, generator=gen) for n, s in shapes.items()}
                  for _ in range(3)]
        deltas.append(noise_of_the_same_norms(deltas[0], gen))  # node-3: noise of a plausible norm
        messages = [node.compress(delta, 0) for node, delta in zip(nodes, deltas)]
        for node in nodes:
            for message in messages:
                if message.sender != node.node_id:
                    node.receive(message)
            node.outer_step(0)
        return nodes

    on, off = run(0.5), run(0.0)
    for node in on:
        assert node.last_step.left_out == ("node-3",)
        assert node.last_step.senders == ("node-0", "node-1", "node-2")
        assert all(torch.equal(node.slow_weights[n], on[0].slow_weights[n]) for n in shapes)
    assert off[0].last_step.left_out == () and len(off[0].last_step.senders) == 4
    assert on[0].counters.left_out == 1
    with pytest.raises(Exception, match="noise_ratio must be a number in"):
        DiLoCoXHyperParameters(noise_ratio=2.0)


def test_the_simulator_bans_a_noise_sender_as_the_daemon_does(config, corpus):  # noqa: F811
    """ban_after refusals and the replica never pairs with the noise sender again."""
    from benchmarks.noise_defence import make_adversary
    from node.simulator import Simulation, SimulationSettings

    sim = Simulation(SimulationSettings("noloco", workers=3, inner_steps=3, rounds=10,
                                        snapshot="phi_delta", eval_every=10), config, corpus)
    make_adversary(sim.method, "replica-2", "noloco")
    sim.run()
    network = sim.method.network
    banned = [me for me in ("replica-0", "replica-1") if network.banned(me, "replica-2")]
    assert banned and network.refused == {"noise": sum(network.strikes.values())}
    for me in banned:  # from the round after its last strike on, never paired again
        strikes_seen, after_ban = 0, []
        for pairs in network.pair_history:
            if strikes_seen >= network.ban_after:
                after_ban += [p for p in pairs if set(p) == {me, "replica-2"}]
            strikes_seen += sum(1 for p in pairs if set(p) == {me, "replica-2"})
        assert after_ban == []
