"""NoLoCoRound and DiLoCoXRound (node/rounds/) with real trainers over scripted links.

A scripted link (a fake, named as such: the real links are the daemon's exchanges, tested in
tests/integration, and the simulator's, tested in test_simulator.py) hands the round exactly
the partner snapshot or group messages a test chooses, and records what the round sent,
announced and refused. Messages are encoded by the rounds' own payload modules.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from node.config.manifest import ContributionSection, ProtocolSection
from node.config.schema import load_config
from node.data.corpus import load_corpus
from node.events import PairCorrected
from node.rounds.dilocox import payload as dilocox_payload
from node.rounds.dilocox.consensus import NOTHING_AGREED
from node.rounds.dilocox.link import GroupMessage, SwarmState
from node.rounds.dilocox.round import DiLoCoXRound
from node.rounds.noloco import payload as noloco_payload
from node.rounds.noloco.round import NoLoCoRound, PartnerSnapshot, rounding_seed
from node.rounds.wire_tensors import WIRE_DTYPES, to_wire
from node.simulator.exchange import InMemoryMessage
from node.train.trainer import InnerTrainer
from p2p.messages import OutgoingTensor
from protocol.noloco import NoLoCoHyperParameters, NoLoCoSnapshot, noloco_update
from protocol.tensors import weights_digest
from tests.unit.test_noloco_wire import block_scales

TINY = ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "model.ffn_hidden=64",
        "data.seq_len=32", "train.micro_batch_size=2", "train.tokens_per_step=64",
        "train.warmup_steps=1", "train.eval_batches=1", "train.lr=1e-2", "train.steps=40"]
H = 3


@pytest.fixture(scope="module")
def config():
    return load_config(overrides=TINY)


@pytest.fixture(scope="module")
def corpus(config):
    return load_corpus(config.data)


def trainer(config, corpus, stream: int) -> InnerTrainer:
    return InnerTrainer(config.model, config.train, corpus, config.data.seq_len, stream,
                        torch.device("cpu"))


def train_round(trainer: InnerTrainer, policy, round_index: int) -> list:
    """What the worker does within a round: between_steps before each step; the events."""
    events = []
    for _ in range(H):
        events.append(policy.between_steps(round_index))
        trainer.train_step()
    return [e for e in events if e is not None]


def received(round_index: int, tensors: list) -> InMemoryMessage:
    return InMemoryMessage(round_index, tensors)


class ScriptedNoLoCoLink:
    """A fake NoLoCoLink: a partner snapshot lands when the test says so."""

    def __init__(self):
        self.waiting: dict[int, PartnerSnapshot] = {}
        self.offered: list[tuple[int, list, float]] = []
        self.refusals: list[tuple[str, str]] = []
        self.catch_up: int | None = None

    def partner_landed(self) -> bool:
        return any(self.waiting.values())  # None: a pair formed, its snapshot not landed yet

    def take_partner(self, round_index: int) -> PartnerSnapshot | None:
        """The oldest snapshot waiting for a pair of `round_index` or before (one landing late)."""
        landed = [r for r, snapshot in self.waiting.items() if r <= round_index and snapshot]
        if not landed:
            return None
        pair_round = min(landed)
        return dataclasses.replace(self.waiting.pop(pair_round), pair_round=pair_round)

    def pending_pair_rounds(self) -> set[int]:
        return set(self.waiting)

    def finish_round(self, round_index, snapshot, wait_s, next_round=None):
        self.offered.append((round_index, snapshot, wait_s))
        return self.waiting.pop(round_index, None) if wait_s else None

    def catch_up_round(self, round_index: int) -> int | None:
        return self.catch_up

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        self.refusals.append((peer, reason))


def noloco(config, corpus, timing: str, stream: int = 1, snapshot: str = "theta",
           wire_dtype: str = "bf16"):
    section = ProtocolSection(timing=timing, inner_steps=H, pair_deadline_s=5.0, snapshot=snapshot,
                              wire_dtype=wire_dtype)
    link = ScriptedNoLoCoLink()
    model = trainer(config, corpus, stream)
    return NoLoCoRound(section, ContributionSection(), model, link), link, model


def partner_of(config, corpus, round_index: int, wire_dtype: str = "fp32",
               layout: str = "theta") -> tuple:
    """Another node's round: its snapshot as it would arrive (in `layout`), and as it was."""
    policy, _, model = noloco(config, corpus, "blocking", stream=2)
    for r in range(round_index + 1):
        train_round(model, policy, r)
        snapshot = policy.outer.snapshot(model.named_parameters())
        if r < round_index:
            policy.end_round(r)
    message = received(round_index, noloco_payload.encode_snapshot(snapshot, wire_dtype, layout))
    return PartnerSnapshot("partner", round_index, message), snapshot


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
    correction is β·(mean θ − θ_i) with our θ of S_0, not of a later round (PROTOCOLS.md §1)."""
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
    policy, link, model = noloco(config, corpus, "overlap")
    train_round(model, policy, 0)
    link.catch_up = 7
    outcome = policy.end_round(0)
    assert outcome.caught_up_to == 7 and model.step == 7 * H
    assert link.offered[0][0] == 0


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


# ---------------------------------------------------------------------------- DiLoCoX
class ScriptedDiLoCoXLink:
    """A fake DiLoCoXLink: the group's messages and a resync state are what the test gives."""

    def __init__(self):
        self.sent: list[tuple[int, list]] = []
        self.inbox: dict[int, list[GroupMessage]] = {}
        self.digests: list[tuple[int, str]] = []
        self.resync: dict[int, dict] = {}
        self.refusals: list[tuple[str, str]] = []
        self.ratio: float | None = None  # what send_ratio reports
        self.catch_ups: dict[int, SwarmState] = {}  # round ended -> the swarm's state
        self.rejoined: list[tuple[int, int]] = []  # (the round we skipped, the swarm's round)
        self.behind_in: set[int] = set()  # rounds a majority of the swarm finished a round ago
        self.applied: dict[int, tuple | None] = {}  # round -> what its step applied (a replay's record)
        self.agreed = -1  # what last_agreed reports: the last round a consensus check agreed
        self.failed: list[tuple[int, int, int | None]] = []  # replays failed: (since, round, start)
        self.drawn = True  # what in_committee reports: everyone sends

    def in_committee(self, round_index: int) -> bool:
        return self.drawn

    def send_round(self, round_index: int, tensors: list) -> None:
        self.sent.append((round_index, tensors))

    def collect(self, round_index: int, wait_s: float) -> list[GroupMessage]:
        return self.inbox.pop(round_index, [])

    def ran_ahead(self) -> float:
        return 0.0

    def behind(self, round_index: int) -> bool:
        return round_index in self.behind_in

    def publish_digest(self, round_index: int, digest: str, applied=None) -> None:
        self.digests.append((round_index, digest))
        self.applied[round_index] = applied

    def take_resync(self, round_index: int) -> dict | None:
        return self.resync.pop(round_index, None)

    def replay_failed(self, recipe: dict, start: int | None) -> None:
        self.failed.append((recipe["since"], recipe["round"], start))
        self.agreed = NOTHING_AGREED if start is None else start  # as the exchange's consensus does

    def last_agreed(self) -> int:
        return self.agreed

    def settle(self, round_index: int, wait_s: float) -> None:
        pass

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        self.refusals.append((peer, reason))

    def send_ratio(self) -> float | None:
        return self.ratio

    def shared_ratio(self) -> float:
        return 0.0

    def take_if_complete(self, round_index: int) -> list[GroupMessage] | None:
        return self.inbox.pop(round_index, None)

    def catch_up(self, round_index: int, reference: dict) -> SwarmState | None:
        state = self.catch_ups.pop(round_index, None)
        return state() if callable(state) else state  # a callable: the swarm moves on meanwhile

    def rejoin(self, from_round: int, state: SwarmState) -> None:
        self.rejoined.append((from_round, state.next_round))



def dilocox(config, corpus, name: str, stream: int, delay: int = 1):
    section = ProtocolSection(name="dilocox", inner_steps=H, codec="bf16", delay=delay)
    link = ScriptedDiLoCoXLink()
    model = trainer(config, corpus, stream)
    return DiLoCoXRound(section, ContributionSection(), model, name, link), link, model


def test_dilocox_applies_the_groups_messages_a_round_late_and_all_agree(config, corpus):
    """Two nodes, each handed the other's message: after round 1 (which applies round 0) they
    hold the same φ, announced by digest; round 0 applied nothing yet (delay 1)."""
    a, a_link, a_model = dilocox(config, corpus, "a", 1)
    b, b_link, b_model = dilocox(config, corpus, "b", 2)
    for r in range(2):
        for policy, model in ((a, a_model), (b, b_model)):
            train_round(model, policy, r)
        a_out = a.end_round(r)
        b_out = b.end_round(r)
        a_link.inbox[r] = [GroupMessage("b", r, received(r, b_link.sent[-1][1]))]
        b_link.inbox[r] = [GroupMessage("a", r, received(r, a_link.sent[-1][1]))]
        if r == 0:
            assert a_out.applied_round is None and a_out.group == []
    assert a_out.applied_round == 0 and a_out.group == ["a", "b"] == b_out.group
    assert a_out.phi_digest == b_out.phi_digest == a_link.digests[-1][1] == b_link.digests[-1][1]
    assert a_out.refused == [] and a_out.sent_bytes > 0 and a_out.partners == ["a", "b"]


def test_dilocox_refuses_a_poisoned_message_and_a_poisoned_resync_and_adopts_a_resync(config, corpus):
    a, link, model = dilocox(config, corpus, "a", 1, delay=0)
    other, other_link, other_model = dilocox(config, corpus, "c", 3, delay=0)
    train_round(other_model, other, 0)
    other.end_round(0)
    tensors = other_link.sent[-1][1]
    poisoned = dilocox_payload.decode_message("c", 0, received(0, tensors))
    for name, encoded in poisoned.tensors.items():
        values = torch.full((len(encoded.payload) // 2,), math.nan, dtype=torch.bfloat16)
        poisoned.tensors[name] = type(encoded)(encoded.description, values.view(torch.uint8).numpy().tobytes())
    link.inbox[0] = [GroupMessage("c", 0, received(0, dilocox_payload.encode_message(poisoned)))]
    train_round(model, a, 0)
    outcome = a.end_round(0)
    assert outcome.group == ["a"] and len(outcome.refused) == 1 and "c" in outcome.refused[0]
    assert link.refusals and link.refusals[0][0] == "c"
    # a resync: the majority's φ and m after round 0, adopted before the next outer step
    _, majority, digest = other.export_state(0)
    link.resync[0] = {"slow_weights": majority["phi"], "momentum": majority["momentum"]}
    train_round(model, a, 1)
    outcome = a.end_round(1)
    assert outcome.resyncs == 1
    assert a.export_state(0)[2] == digest  # a member asking for round 0 is served the majority's
    assert a.agreed[0] == 0  # and a replay would start from it
    # a poisoned resync (its digest won the vote; issue 24): checked as a contribution, refused
    link.resync[1] = {"slow_weights": {n: torch.full_like(t, math.nan) for n, t in majority["phi"].items()},
                      "momentum": majority["momentum"], "source": "liar"}
    train_round(model, a, 2)
    outcome = a.end_round(2)
    assert outcome.resyncs == 1 and ("liar", "not_finite") in link.refusals


def dilocox_trio(config, corpus) -> dict:
    """Nodes a, b and c (each its own data stream): name -> (round, link, trainer)."""
    return {name: dilocox(config, corpus, name, stream) for name, stream in (("a", 1), ("b", 2), ("c", 3))}


C_MISSES_B_AT_0 = {("b", "c")}  # (sender, receiver): c's step of round 1 lacks b's message


def play_dilocox(nodes: dict, r: int, sent: dict, outcomes: dict, missed=()) -> None:
    """Round `r` of the DiLoCoX `nodes` (name -> (round, link, trainer)): each trains and ends
    it, and then holds every other node's message of it but the (sender, receiver) `missed`."""
    for name, (policy, link, model) in nodes.items():
        train_round(model, policy, r)
        outcomes[name] = policy.end_round(r)
        sent[(name, r)] = received(r, link.sent[-1][1])
    for name, (_, link, _) in nodes.items():
        link.inbox[r] = [GroupMessage(p, r, sent[(p, r)]) for p in nodes
                         if p != name and (p, name) not in missed]


def test_dilocox_a_node_that_missed_a_message_replays_its_steps_over_the_majoritys(config, corpus):
    """c missed b's message of round 0, so its step of round 1 applied {a, c} where a and b
    applied {a, b, c}, and its step of round 2 built on that: its φ left theirs. Handed a's
    records of its steps and b's message, it replays them from the initial state (no check has
    agreed yet) at its next outer step and holds their φ again, bitwise, having moved one message instead of
    φ and m. A recipe whose digest it cannot reproduce (records naming the wrong senders) is
    dropped, not adopted, and its agreed state is no longer where replays start (the one before
    it is); nor is one from a round it does not hold as agreed adopted."""
    nodes = dilocox_trio(config, corpus)
    sent, outcomes = {}, {}
    a_link, c_link = nodes["a"][1], nodes["c"][1]
    for r in range(4):
        play_dilocox(nodes, r, sent, outcomes, missed=C_MISSES_B_AT_0 if r == 0 else ())
        if r == 0:
            assert a_link.applied[0] == (-1, ())  # nothing was due: a step a replay goes through
        if r in (1, 2):
            assert outcomes["a"].phi_digest == outcomes["b"].phi_digest != outcomes["c"].phi_digest
        if r == 2:
            assert a_link.applied[1] == (0, ("a", "b", "c")) and c_link.applied[1] == (0, ("a", "c"))
            c_link.resync[2] = {"replay": {  # from the initial state: no check agreed yet
                "since": -1, "round": 2, "steps": [(r, *a_link.applied[r]) for r in (0, 1, 2)],
                "messages": {(0, "b"): sent[("b", 0)]}, "digest": outcomes["a"].phi_digest}}
    assert outcomes["a"].phi_digest == outcomes["b"].phi_digest == outcomes["c"].phi_digest
    assert outcomes["c"].replays == 1 and outcomes["c"].resyncs == 0 and outcomes["a"].replays == 0
    c, _, c_model = nodes["c"]
    assert c.agreed[0] == 2  # the replayed state: a later replay starts there, whatever the link says
    # records that name the wrong senders: the replay does not reach the majority's φ
    c_link.resync[3] = {"replay": {"since": 2, "round": 3, "steps": [(3, 2, ("a", "c"))],
                                   "messages": {}, "digest": outcomes["a"].phi_digest}}
    # and one from before a round it holds as agreed, whose steps after that are the same wrong ones
    c_link.resync[4] = {"replay": {"since": 0, "round": 4, "steps": [
        (1, 0, ("a", "b", "c")), (2, 1, ("a", "b", "c")), (3, 2, ("a", "c")), (4, 3, ("a", "c"))],
        "messages": {}, "digest": outcomes["a"].phi_digest}}
    for r in (4, 5):
        c_link.inbox[r - 1] = []
        train_round(c_model, c, r)
        assert c.end_round(r).replays == 1  # dropped: its step went on from its own φ
        if r == 4:  # no replay from the state of round 2 again: from the initial φ next
            assert c.agreed[0] == -1 and c_link.failed == [(2, 3, -1)]
    assert c_link.failed[1:] == [(0, 4, -1)]  # not from round 0: it holds no agreed state of it


def test_dilocox_a_replay_from_a_wrongly_agreed_round_falls_back_to_the_agreed_state_before_it(
        config, corpus):
    """The 512 kbit/s run R10: c's check counted round 1 agreed though its φ of round 1 was not
    the majority's (it missed b's message of round 0). A replay from round 1 over a's true
    records cannot give a's φ: c goes back to its agreed state before (round 0), the link is
    told so, and the next recipe, from round 0, brings c to a's φ without any download."""
    nodes = dilocox_trio(config, corpus)
    sent, outcomes = {}, {}
    a_link, c_link = nodes["a"][1], nodes["c"][1]
    c = nodes["c"][0]
    for r in range(5):
        play_dilocox(nodes, r, sent, outcomes, missed=C_MISSES_B_AT_0 if r == 0 else ())
        if r in (0, 1):
            c_link.agreed = r  # round 0 was agreed; round 1 was counted so, wrongly
        if r == 2:
            assert c.agreed[0] == 1 and c.agreed_before[0] == 0
            assert outcomes["a"].phi_digest != outcomes["c"].phi_digest
            c_link.resync[2] = {"replay": {"since": 1, "round": 2, "steps": [(2, *a_link.applied[2])],
                                           "messages": {}, "digest": outcomes["a"].phi_digest}}
        if r == 3:  # that replay failed: back to round 0, and the link replays from there
            assert c_link.failed == [(1, 2, 0)] and c.agreed[0] == 0 and c_link.agreed == 0
            assert outcomes["c"].replays == 0
            c_link.resync[3] = {"replay": {
                "since": 0, "round": 3, "steps": [(r, *a_link.applied[r]) for r in (1, 2, 3)],
                "messages": {(0, "b"): sent[("b", 0)]}, "digest": outcomes["a"].phi_digest}}
    assert outcomes["a"].phi_digest == outcomes["b"].phi_digest == outcomes["c"].phi_digest
    assert outcomes["c"].replays == 1 and outcomes["c"].resyncs == 0 and c.agreed[0] == 3


def test_dilocox_a_replay_that_comes_a_round_late_is_taken_with_our_own_steps_since(config, corpus):
    """c missed b's message of round 0, so its φ of round 1 left a's and b's; the check that
    found it came late (c was ahead of them: their votes come at their round's end), after c's
    step of round 2 over the same messages as theirs. At its step of round 3 c replays the
    majority's step 1 from its initial state, then its own step 2 over that, and holds their φ
    again; its agreed state is round 1's, the last one verified."""
    nodes = dilocox_trio(config, corpus)
    sent, outcomes = {}, {}
    a_link, c_link = nodes["a"][1], nodes["c"][1]
    for r in range(4):
        play_dilocox(nodes, r, sent, outcomes, missed=C_MISSES_B_AT_0 if r == 0 else ())
        if r == 1:
            theirs_of_1 = outcomes["a"].phi_digest
            assert theirs_of_1 == outcomes["b"].phi_digest != outcomes["c"].phi_digest
        if r == 2:
            assert outcomes["a"].phi_digest != outcomes["c"].phi_digest
            c_link.resync[2] = {"replay": {  # of round 1, handed over at the step of round 3
                "since": -1, "round": 1, "steps": [(r, *a_link.applied[r]) for r in (0, 1)],
                "messages": {(0, "b"): sent[("b", 0)]}, "digest": theirs_of_1}}
    assert outcomes["a"].phi_digest == outcomes["b"].phi_digest == outcomes["c"].phi_digest
    assert outcomes["c"].replays == 1 and nodes["c"][0].agreed[0] == 1


def test_dilocox_a_late_joiners_first_step_is_replayed_from_the_state_it_adopted(config, corpus):
    """d joins with a's state after round 1 and trains round 2; the messages of round 1 were
    sent before it joined, so its step applies none and its φ leaves a's and b's. The state it
    adopted is its agreed state: handed a's record and both messages, its next step holds their
    φ. (Before, it had no state to replay from and downloaded the state again: a real swarm's
    restarted node, tests/integration/test_fault_points.py.)"""
    nodes = {name: dilocox(config, corpus, name, stream) for name, stream in (("a", 1), ("b", 2))}
    sent, outcomes = {}, {}
    for r in (0, 1):
        play_dilocox(nodes, r, sent, outcomes)
    d = dilocox(config, corpus, "d", 4)
    state_round, groups, _ = nodes["a"][0].export_state(1)
    d[0].adopt(groups, state_round)
    assert d[0].export_state(1)[2] == outcomes["a"].phi_digest
    nodes["d"] = d
    play_dilocox(nodes, 2, sent, outcomes)
    assert outcomes["d"].group == [] and outcomes["d"].phi_digest != outcomes["a"].phi_digest
    d[1].resync[2] = {"replay": {"since": 1, "round": 2, "steps": [(2, 1, ("a", "b"))],
                                 "messages": {(1, "a"): sent[("a", 1)], (1, "b"): sent[("b", 1)]},
                                 "digest": outcomes["a"].phi_digest}}
    play_dilocox(nodes, 3, sent, outcomes)
    assert outcomes["d"].replays == 1 and outcomes["d"].resyncs == 0
    assert outcomes["a"].phi_digest == outcomes["b"].phi_digest == outcomes["d"].phi_digest


def test_dilocox_finish_applies_the_last_rounds_messages_without_training(config, corpus):
    a, link, model = dilocox(config, corpus, "a", 1)
    train_round(model, a, 0)
    a.end_round(0)
    link.inbox[0] = []
    before = a.phi_digest
    a.finish(1)
    assert link.digests[-1] == (1, a.phi_digest) and a.phi_digest != before  # own message applied
    assert len(link.sent) == 1  # nothing more sent


def test_dilocox_that_fell_behind_takes_the_swarms_state_and_round_then_goes_on(config, corpus):
    """The link reports the node fell behind (its swarm agreed on a state of round 5): the round
    adopts that φ and m with θ = φ, drops its own message in flight, moves its step counter to
    round 6, and its next round's outer step goes on from the adopted φ."""
    a, link, model = dilocox(config, corpus, "a", 1)
    swarm, swarm_link, swarm_model = dilocox(config, corpus, "s", 2)
    for r in range(2):
        train_round(swarm_model, swarm, r)
        swarm.end_round(r)
    state_round, state, digest = swarm.export_state()
    train_round(model, a, 0)
    ended_at = a.phi_digest
    link.catch_ups[0] = SwarmState(6, 5, state, "s", digest)
    outcome = a.end_round(0)
    assert outcome.caught_up_to == 6 and outcome.phi_digest != digest  # round 0's own φ reported
    assert link.rejoined == [(1, 6)]
    assert a.phi_digest == digest == weights_digest(model.named_parameters()) != ended_at
    assert model.step == 6 * H and a.export_state()[0] == 5
    train_round(model, a, 6)
    link.inbox[5] = []
    outcome = a.end_round(6)
    # round 5 was not ours to train: its step holds no message of ours (and no stale one)
    assert outcome.caught_up_to is None and outcome.applied_round == 5 and outcome.group == []
    assert link.digests[-1] == (6, a.phi_digest) and len(link.sent) == 2


def test_dilocox_a_node_behind_catches_up_by_replaying_the_swarms_steps(config, corpus):
    """c trains rounds 0 and 1 with a and b and falls behind: by the time it ends round 1, a and
    b took the steps of rounds 2-4, the first over c's own message of round 1. Handed a's records
    of those steps (c's φ of round 1 was agreed) and a's and b's messages, c replays them (its
    own message as it sent it), holds their φ of round 4 and trains round 5 next: it moved their
    messages instead of φ and m. A recipe whose digest it cannot reproduce leaves it where it
    was: no state, no move to the swarm's round."""
    nodes = dilocox_trio(config, corpus)
    sent, outcomes = {}, {}
    play_dilocox(nodes, 0, sent, outcomes)
    pair = {name: nodes[name] for name in ("a", "b")}
    play_dilocox(pair, 1, sent, outcomes)
    theirs_of_1 = outcomes["a"].phi_digest
    c, c_link, c_model = nodes["c"]
    c_link.agreed = 1  # its φ of round 1 was the majority's (checked below)

    def swarm_moves_on() -> SwarmState:
        sent[("c", 1)] = received(1, c_link.sent[-1][1])  # sent at c's round end, before this
        for name, (_, link, _) in pair.items():
            link.inbox[1].append(GroupMessage("c", 1, sent[("c", 1)]))
        for r in (2, 3, 4):
            play_dilocox(pair, r, sent, outcomes)
        a_link = nodes["a"][1]
        steps = [(r, *a_link.applied[r]) for r in (2, 3, 4)]
        assert steps[0] == (2, 1, ("a", "b", "c"))  # c's own message is in the swarm's step
        messages = {(r, p): sent[(p, r)] for r in (1, 2, 3) for p in ("a", "b")}
        return SwarmState(5, 4, {"replay": {"since": 1, "round": 4, "steps": steps, "messages": messages,
                                            "digest": outcomes["a"].phi_digest}}, "a",
                          outcomes["a"].phi_digest)
    c_link.catch_ups[1] = swarm_moves_on
    train_round(c_model, c, 1)
    outcome = c.end_round(1)
    assert outcome.phi_digest == theirs_of_1  # round 1's φ, agreed indeed
    assert outcome.caught_up_to == 5 and outcome.replays == 1 and outcome.resyncs == 0
    assert c.phi_digest == outcomes["a"].phi_digest == outcomes["b"].phi_digest
    assert c_link.rejoined == [(2, 5)] and c_model.step == 5 * H and c.agreed[0] == 4
    # a recipe naming the wrong senders: its digest is not reached, and c trains on as it was
    c_link.catch_ups[5] = SwarmState(8, 7, {"replay": {"since": 4, "round": 7, "steps": [
        (5, 4, ("c",)), (6, 5, ("c",)), (7, 6, ("c",))], "messages": {}, "digest": "0" * 32}}, "a", "0" * 32)
    c_link.inbox[4] = []
    train_round(c_model, c, 5)
    outcome = c.end_round(5)
    assert outcome.caught_up_to is None and c_link.rejoined == [(2, 5)] and c_model.step == 6 * H


def test_dilocox_a_round_behind_its_swarm_ends_at_its_next_step(config, corpus):
    """The link says a majority finished the round after round 1 while this node trains round 1:
    the round ends after its next step (the steps that would have made its message late are
    skipped, reported), its message is sent as round 1's, and round 2 is whole again."""
    a, link, model = dilocox(config, corpus, "a", 1)
    link.behind_in = {1}
    train_round(model, a, 0)
    a.end_round(0)
    trained, events = {}, []
    for r in (1, 2):
        trained[r] = 0
        while model.step < (r + 1) * H:  # the worker's loop: a round ends at a multiple of H
            events.append(a.between_steps(r))
            model.train_step()
            trained[r] += 1
        a.end_round(r)
    assert trained == {1: 1, 2: H}
    assert [(e.round, e.skipped_steps) for e in events if e is not None] == [(1, H - 1)]
    assert [r for r, _ in link.sent] == [0, 1, 2]
