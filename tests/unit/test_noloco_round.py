"""NoLoCoRound (node/rounds/noloco/) with real trainers over a scripted link
(tests/round_parts.py): the pair formula, overlap, wire layouts and dtypes, refusals, and a
node out of step with its swarm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from node.config.manifest import ContributionSection, ProtocolSection
from node.daemon.state_quorum import JoinState
from node.events import PairCorrected
from node.rounds.noloco import payload as noloco_payload
from node.rounds.noloco.round import NoLoCoRound, PartnerSnapshot, rounding_seed
from node.rounds.wire_tensors import WIRE_DTYPES, to_wire
from p2p.messages import OutgoingTensor
from protocol.noloco import NoLoCoHyperParameters, NoLoCoSnapshot, noloco_update
from protocol.tensors import weights_digest
from tests.round_parts import config, corpus  # noqa: F401 (fixtures)
from tests.round_parts import H, ScriptedNoLoCoLink, noloco, partner_of, received, train_round, trainer
from tests.unit.test_noloco_wire import block_scales


def test_blocking_applies_the_partners_snapshot_with_the_pair_formula(config, corpus):
    policy, link, model = noloco(config, corpus, "blocking", snapshot="phi_delta")
    partner, theirs = partner_of(config, corpus, 0, layout="phi_delta")
    train_round(model, policy, 0)
    phi, momentum = policy.outer.slow_weights, policy.outer.outer_momentum
    own = policy.outer.snapshot(model.named_parameters())
    link.waiting[0] = partner
    outcome = policy.end_round(0)
    expected, _ = noloco_update(phi, momentum, [own, theirs], NoLoCoHyperParameters())
    assert outcome.partner == "partner" and outcome.partners == ["partner"]
    assert not outcome.local_update and outcome.partner_updates == 1 and outcome.refused == []
    assert outcome.phi_digest == weights_digest(expected) == weights_digest(policy.outer.slow_weights)
    for name, tensor in model.named_parameters().items():  # θ starts the next round at φ
        assert torch.equal(tensor.detach(), expected[name])
    assert link.offered[0][0] == 0 and link.offered[0][2] == 5.0  # it waited the deadline


def test_overlap_corrects_at_the_step_boundary_after_the_partner_lands(config, corpus):
    """The pair's update arrives one round late, mid-round: θ and φ move by the correction,
    the event carries φ's new digest, and the round ends with the local update on top."""
    policy, link, model = noloco(config, corpus, "overlap")
    partner, _ = partner_of(config, corpus, 0)
    train_round(model, policy, 0)
    first = policy.end_round(0)
    assert first.local_update and first.partner is None and first.pair_shift is None
    assert link.offered[0][2] == 0.0  # overlap never waits
    link.waiting[1] = partner  # the pair of round 1 swapped our S_0 for the partner's
    before = {n: t.detach().clone() for n, t in model.named_parameters().items()}
    phi_before = policy.phi_digest
    events = train_round(model, policy, 1)
    assert len(events) == 1 and isinstance(events[0], PairCorrected)
    corrected = events[0]
    assert corrected.partner == "partner" and corrected.round == 0
    assert corrected.phi_before == phi_before != corrected.phi_digest
    assert corrected.shift > 0 and not any(torch.equal(before[n], t) for n, t in
                                           model.named_parameters().items())
    outcome = policy.end_round(1)
    assert outcome.partner == "partner" and outcome.partner_round == 0
    assert outcome.pair_shift == corrected.shift and outcome.partner_updates == 1


def test_overlap_applies_a_swap_that_outlasted_its_round_against_the_snapshot_it_swapped(config, corpus):
    """A slow link: the pair of round 1 (our S_0 for the partner's) lands during round 3. Its
    correction is β·(mean θ − θ_i) with our θ of S_0, not of a later round (docs/protocols.md §1)."""
    policy, link, model = noloco(config, corpus, "overlap")
    partner, theirs = partner_of(config, corpus, 0)
    train_round(model, policy, 0)
    ours = policy.outer.snapshot(model.named_parameters()).fast_weights()
    link.waiting[1] = None  # the pair of round 1 formed; its swap is still in flight
    for r in range(3):
        if r:
            train_round(model, policy, r)
        assert policy.end_round(r).local_update
        assert 1 in policy.offered  # S_0 is kept while its pair may land
    link.waiting[1] = partner
    events = train_round(model, policy, 3)
    beta = ProtocolSection().progress_weight
    expected = math.sqrt(sum(float(((beta / 2) * (theirs.fast_weights()[n] - ours[n])).square().sum())
                             for n in ours))
    assert len(events) == 1 and events[0].shift == pytest.approx(expected, rel=1e-5)
    assert policy.end_round(3).partner == "partner" and 1 not in policy.offered


def test_a_poisoned_snapshot_is_refused_counted_and_never_applied(config, corpus):
    policy, link, model = noloco(config, corpus, "blocking")
    partner, theirs = partner_of(config, corpus, 0)
    poisoned = NoLoCoSnapshot(theirs.slow_weights, {n: torch.full_like(t, math.nan)
                                                    for n, t in theirs.local_progress.items()})
    link.waiting[0] = PartnerSnapshot("bad", 0, received(0, noloco_payload.encode_snapshot(
        poisoned, "fp32", "theta")))
    train_round(model, policy, 0)
    phi, momentum = policy.outer.slow_weights, policy.outer.outer_momentum
    own = policy.outer.snapshot(model.named_parameters())
    outcome = policy.end_round(0)
    local, _ = noloco_update(phi, momentum, [own], NoLoCoHyperParameters())
    assert outcome.local_update and outcome.partner is None
    assert len(outcome.refused) == 1 and "NaN" in outcome.refused[0] and "bad" in outcome.refused[0]
    assert link.refusals == [("bad", "not_finite")]
    assert outcome.phi_digest == weights_digest(local)


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_payload_round_trips_both_layouts_and_theta_is_half_the_bytes(wire_dtype):
    torch.manual_seed(0)
    phi = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    snapshot = NoLoCoSnapshot(phi, {n: 0.01 * torch.randn_like(t) for n, t in phi.items()})
    wire = lambda t: t.to(WIRE_DTYPES[wire_dtype]).float()
    sizes = {}
    for layout, sent in (("theta", {"theta": snapshot.fast_weights()}),
                         ("phi_delta", {"phi": phi, "delta": snapshot.local_progress})):
        tensors = noloco_payload.encode_snapshot(snapshot, wire_dtype, layout)
        groups = noloco_payload.decode_snapshot(received(0, tensors), layout, "peer")
        assert set(groups) == set(sent) and all(set(groups[g]) == set(phi) for g in groups)
        for group, values in sent.items():
            for name, tensor in values.items():
                assert torch.equal(groups[group][name], wire(tensor))
        sizes[layout] = sum(t.data.nbytes for t in tensors)
    element_bytes = torch.empty(0, dtype=WIRE_DTYPES[wire_dtype]).element_size()
    for layout, size in sizes.items():  # 17 elements a set: theta sends one set, phi_delta two
        assert size == noloco_payload.tensor_sets(layout) * 17 * element_bytes
    assert 2 * sizes["theta"] == sizes["phi_delta"]


def test_a_theta_only_partner_gives_the_phi_delta_paths_phi_within_bf16_rounding(config, corpus):
    """Two identical nodes take the same partner's round-0 snapshot in bf16, one as θ alone and
    one as φ and Δ. Rounding to bf16 moves each value by at most u = 2^-8 of its magnitude, and
    the partner enters φ_i only as β/2·θ_j (θ path) or β/2·(φ_j + Δ_j) (φ, Δ path), so against
    the exact fp32 update the θ path errs by at most β/2·u·|θ_j|, the other by β/2·u·(|φ_j| +
    |Δ_j|), and each from the other by the sum (elementwise, plus fp32 slack)."""
    beta, u, slack = NoLoCoHyperParameters().progress_weight, 2.0 ** -8, 1e-6
    nodes = {layout: noloco(config, corpus, "blocking", snapshot=layout)
             for layout in ("theta", "phi_delta")}
    owns = {}
    for layout, (policy, link, model) in nodes.items():
        link.waiting[0], theirs = partner_of(config, corpus, 0, "bf16", layout)
        train_round(model, policy, 0)
        phi, momentum = policy.outer.slow_weights, policy.outer.outer_momentum
        owns[layout] = own = policy.outer.snapshot(model.named_parameters())
        assert not policy.end_round(0).local_update and link.refusals == []
    assert weights_digest(owns["theta"].fast_weights()) == weights_digest(own.fast_weights())
    exact, _ = noloco_update(phi, momentum, [own, theirs], NoLoCoHyperParameters())
    theta_phi, pair_phi = (nodes[k][0].outer.slow_weights for k in ("theta", "phi_delta"))
    for name, want in exact.items():
        theta_j = theirs.fast_weights()[name].abs()
        phi_delta_j = theirs.slow_weights[name].abs() + theirs.local_progress[name].abs()
        assert ((theta_phi[name] - want).abs() <= beta / 2 * u * theta_j + slack).all()
        assert ((pair_phi[name] - want).abs() <= beta / 2 * u * phi_delta_j + slack).all()
        assert ((theta_phi[name] - pair_phi[name]).abs()
                <= beta / 2 * u * (theta_j + phi_delta_j) + 2 * slack).all()


def _bad_theta(theirs, case: str) -> list:
    theta = theirs.fast_weights()
    if case == "layout":  # φ and Δ where θ is expected
        return noloco_payload.encode_snapshot(theirs, "bf16", "phi_delta")
    if case == "not_finite":
        theta = {n: t.clone().fill_(math.inf) if i == 0 else t for i, (n, t) in enumerate(theta.items())}
    if case == "norm":
        theta = {n: 11.0 * t for n, t in theta.items()}  # max_norm_ratio is 10
    return to_wire(theta, "bf16", "theta/")


def end_round_locally(policy, model):
    """Trains round 0 and ends it; asserts the outcome is the local update of G = {self}."""
    train_round(model, policy, 0)
    phi, momentum = policy.outer.slow_weights, policy.outer.outer_momentum
    own = policy.outer.snapshot(model.named_parameters())
    outcome = policy.end_round(0)
    local, _ = noloco_update(phi, momentum, [own], NoLoCoHyperParameters())
    assert outcome.local_update and outcome.partner is None and outcome.partner_updates == 0
    assert outcome.phi_digest == weights_digest(local) == weights_digest(model.named_parameters())
    return outcome


@pytest.mark.parametrize("snapshot, case, sentence", [
    ("theta", "layout", "carries the groups ['delta', 'phi'], but protocol.snapshot = 'theta'"),
    ("phi_delta", "layout", "carries the groups ['theta'], but protocol.snapshot = 'phi_delta'"),
    ("theta", "not_finite", "NoLoCo fast weights from bad holds NaN or Inf"),
    ("theta", "norm", "NoLoCo fast weights from bad has norm"),
])
def test_a_wrong_layout_or_bad_theta_is_refused_and_the_round_goes_on_locally(
        config, corpus, snapshot, case, sentence):
    policy, link, model = noloco(config, corpus, "blocking", snapshot=snapshot)
    _, theirs = partner_of(config, corpus, 0)
    if snapshot == "theta":
        tensors = _bad_theta(theirs, case)
    else:  # θ where φ and Δ are expected
        tensors = noloco_payload.encode_snapshot(theirs, "bf16", "theta")
    link.waiting[0] = PartnerSnapshot("bad", 0, received(0, tensors))
    outcome = end_round_locally(policy, model)
    assert link.refusals == [("bad", case)] and len(outcome.refused) == 1
    assert sentence in outcome.refused[0] and outcome.refused[0].endswith("dropped")


@pytest.mark.parametrize("wire_dtype, levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("layout", ["theta", "phi_delta"])
def test_a_quantized_snapshot_is_applied_within_beta_half_of_its_rounding(
        config, corpus, wire_dtype, levels, layout):
    """Each sent tensor is off by at most s/(2L) per element (s its block's absmax; see
    node/rounds/wire_tensors.py), and the partner enters φ_i as β/2·θ_j (or β/2·(φ_j + Δ_j)), so
    φ is off the exact fp32 update by at most β/2·Σ s/(2L) over the tensors sent, plus slack."""
    beta, slack = NoLoCoHyperParameters().progress_weight, 1e-6
    policy, link, model = noloco(config, corpus, "blocking", snapshot=layout, wire_dtype=wire_dtype)
    link.waiting[0], theirs = partner_of(config, corpus, 0, wire_dtype, layout)
    train_round(model, policy, 0)
    phi, momentum = policy.outer.slow_weights, policy.outer.outer_momentum
    own = policy.outer.snapshot(model.named_parameters())
    outcome = policy.end_round(0)
    assert not outcome.local_update and outcome.partner == "partner" and link.refusals == []
    exact, _ = noloco_update(phi, momentum, [own, theirs], NoLoCoHyperParameters())
    sent = [theirs.fast_weights()] if layout == "theta" else [theirs.slow_weights,
                                                              theirs.local_progress]
    for name, want in exact.items():
        bound = beta / 2 * sum(block_scales(group[name]) for group in sent) / (2 * levels)
        assert ((policy.outer.slow_weights[name] - want).abs() <= bound + slack).all()


def test_stochastic_rounding_gives_each_node_its_own_unbiased_draws(config, corpus):
    """protocol.wire_rounding = "stochastic": the snapshot a node offers is rounded with its own
    generator (rounding_seed: the daemon's seed and peer id), so two nodes holding the same θ
    send different codes, and one node sends the same ones again from the same seed."""
    def offered(rounding: str, seed: int) -> list[bytes]:
        section = ProtocolSection(timing="overlap", inner_steps=H, wire_dtype="int4",
                                  wire_rounding=rounding)
        link = ScriptedNoLoCoLink()
        policy = NoLoCoRound(section, ContributionSection(), trainer(config, corpus, 1), link, seed)
        policy.end_round(0)  # no training: every node offers the same θ
        return [t.data.tobytes() for t in link.offered[0][1]]

    nearest = offered("nearest", 1)
    assert offered("nearest", 2) == nearest  # to nearest, the seed plays no part
    first, again, other = offered("stochastic", 1), offered("stochastic", 1), offered("stochastic", 2)
    assert first == again and first != other and first != nearest
    assert rounding_seed(0, "peer-a") != rounding_seed(0, "peer-b") == rounding_seed(0, "peer-b")


@pytest.mark.parametrize("case", ["length", "scale", "code"])
def test_a_malformed_quantized_snapshot_is_refused_and_the_round_goes_on_locally(config, corpus,
                                                                                 case):
    policy, link, model = noloco(config, corpus, "blocking", wire_dtype="int8")
    partner, _ = partner_of(config, corpus, 0, "int8")
    tensors = list(partner.message.tensors)
    views = partner.message.tensor_views()
    broken = []
    for entry in tensors:
        data = bytearray(views[entry.name][1])
        if entry.name == tensors[0].name:
            if case == "length":
                data = data[:-1]
            elif case == "scale":
                data[0:4] = bytes([0, 0, 0x80, 0x7F])  # +inf as the first block's fp32 scale
            else:
                data[-1] = 0x80  # the 8-bit code −128, never produced
        broken.append(OutgoingTensor(entry.name, "uint8", (len(data),),
                                     np.frombuffer(bytes(data), np.uint8)))
    link.waiting[0] = PartnerSnapshot("bad", 0, received(0, broken))
    outcome = end_round_locally(policy, model)
    assert link.refusals == [("bad", "malformed")] and len(outcome.refused) == 1
    assert outcome.refused[0].startswith("NoLoCo snapshot from bad is malformed: tensor "
                                         f"{tensors[0].name}")


def test_a_node_too_far_behind_jumps_to_the_swarms_round(config, corpus):
    """No state agreed by the swarm: the node keeps its own weights and jumps."""
    policy, link, model = noloco(config, corpus, "overlap")
    train_round(model, policy, 0)
    link.catch_up = 7
    outcome = policy.end_round(0)
    assert outcome.caught_up_to == 7 and model.step == 7 * H
    assert link.offered[0][0] == 0 and link.asked_state == [0]


@pytest.mark.parametrize("timing", ["overlap", "blocking"])
def test_the_first_jump_forward_adopts_the_swarms_state(config, corpus, timing):
    """A node that far behind from its start trained alone: on its first jump it takes the
    state the late-join quorum agreed on (its own progress dropped), offers that φ, and trains
    the agreed round next; later jumps keep its own weights, as every jump did before."""
    member, _, member_model = noloco(config, corpus, "overlap", stream=3)
    for r in range(3):
        train_round(member_model, member, r)
        member.end_round(r)
    state_round, groups, digest = member.export_state()
    policy, link, model = noloco(config, corpus, timing, wire_dtype="fp32")
    train_round(model, policy, 0)
    link.catch_up = 4
    link.swarm = JoinState(4, groups, {"phi_round": state_round, "phi": digest}, "member")
    outcome = policy.end_round(0)
    assert outcome.caught_up_to == 4 and model.step == 4 * H and link.asked_state == [0]
    assert outcome.phi_digest == digest == weights_digest(model.named_parameters())
    assert policy.export_state()[0] == state_round == 2 and outcome.local_update
    offered = noloco_payload.decode_snapshot(received(0, link.offered[0][1]), "theta", "me", "fp32")
    assert weights_digest(offered["theta"]) == digest  # θ = the adopted φ
    train_round(model, policy, 4)
    link.catch_up = 9
    policy.end_round(4)
    assert link.asked_state == [0] and model.step == 9 * H


def test_a_node_too_far_ahead_goes_back_to_the_swarms_round(config, corpus):
    policy, link, model = noloco(config, corpus, "overlap")
    for r in range(4):
        train_round(model, policy, r)
        if r < 3:
            policy.end_round(r)
    phi = weights_digest(policy.outer.slow_weights)
    link.catch_up = 1
    outcome = policy.end_round(3)
    assert outcome.caught_up_to == 1 and model.step == 1 * H
    assert outcome.phi_digest != phi  # its own progress is kept: the outer step still ran
    assert [o[0] for o in link.offered] == [0, 1, 2, 3]


def test_a_late_joiner_adopts_the_exported_state(config, corpus):
    member, _, member_model = noloco(config, corpus, "overlap", stream=3)
    train_round(member_model, member, 0)
    member.end_round(0)
    state_round, groups, digest = member.export_state()
    joiner, _, joiner_model = noloco(config, corpus, "overlap", stream=4)
    joiner.adopt(groups)
    assert state_round == 0 and joiner.phi_digest == digest == weights_digest(joiner.outer.slow_weights)
    assert weights_digest(joiner_model.named_parameters()) == digest  # θ = φ
    restored, _, _ = noloco(config, corpus, "overlap", stream=5)
    restored.load_state_dict(member.state_dict())
    assert weights_digest(restored.outer.slow_weights) == digest
