"""DiLoCoXRound with the top-k codec: the controller's choice each round, the density bound.

Real trainers over the scripted link of tests/round_parts.py (a fake, named as such there).
"""

from __future__ import annotations

from node.config.manifest import ContributionSection, ProtocolSection
from node.rounds.dilocox import payload as dilocox_payload
from node.rounds.dilocox.link import GroupMessage
from node.rounds.dilocox.round import DiLoCoXRound
from protocol.codecs import Encoded
from tests.round_parts import config, corpus  # noqa: F401 (fixtures)
from tests.round_parts import H, ScriptedDiLoCoXLink, received, train_round, trainer


def topk_round(config, corpus, name: str, stream: int, **protocol):
    protocol = {"topk_k": 4, "max_density": 0.25, **protocol}
    section = ProtocolSection(name="dilocox", inner_steps=H, codec="topk", topk_chunk=64, **protocol)
    link = ScriptedDiLoCoXLink()
    model = trainer(config, corpus, stream)
    return DiLoCoXRound(section, ContributionSection(), model, name, link), link, model


def test_controller_raises_k_on_a_free_link_and_lowers_it_on_a_slow_one(config, corpus):
    policy, link, model = topk_round(config, corpus, "a", 1, controller=True, topk_k=16,
                                     controller_energy_target=0.9)
    train_round(model, policy, 0)  # no send measured yet (link.ratio None): k held at the start
    unmeasured = policy.end_round(0).compression
    assert unmeasured["budget"] == "unmeasured" and unmeasured["k_max"] == 4
    assert unmeasured["changes"] == 0 and unmeasured["send_ratio"] is None
    link.ratio = 0.0  # a free link
    train_round(model, policy, 1)
    free = policy.end_round(1).compression
    assert free["codec"] == "topk" and free["budget"] == "slack" and free["k_max"] == 8  # 4 -> 8
    assert free["summary"].startswith("send/compute 0.00 (slack)") and free["changes"] > 0
    assert link.sent[-1][1]  # the round still sent its message
    link.ratio = 2.0  # the last send took twice the round's compute
    train_round(model, policy, 2)
    slow = policy.end_round(2).compression
    assert slow["budget"] == "over" and slow["k_max"] == 4 and slow["send_ratio"] == 2.0
    train_round(model, policy, 3)
    policy.end_round(3)
    sent = dilocox_payload.decode_message("a", 3, received(3, link.sent[-1][1]))
    assert {e.description["k"] for e in sent.tensors.values()} == {4}  # the choice took effect
    # every k stays within the manifest's density bound: 0.25 · 64 = 16
    link.ratio = 0.0
    for r in range(4, 9):
        train_round(model, policy, r)
        assert policy.end_round(r).compression["k_max"] <= 16


def test_after_a_move_up_the_controller_measures_the_new_size_before_the_next(config, corpus):
    """R19: a link that lets a burst through reads free for small messages, and three nodes
    doubled theirs, 53 to 408 KiB in three rounds, onto a 512 kbit/s member. After a raise the
    next decision holds k on a link that still reads free (the new size's send is measured by
    the one after), then k grows again; a move down is never held."""
    policy, link, model = topk_round(config, corpus, "a", 1, controller=True, topk_k=16,
                                     max_density=1.0, controller_energy_target=0.9)
    link.ratio = 0.0
    ks = []
    for r in range(7):
        train_round(model, policy, r)
        ks.append(policy.end_round(r).compression["k_max"])
    assert ks == [8, 8, 16, 16, 32, 32, 64], ks
    link.ratio = 2.0
    train_round(model, policy, 7)
    assert policy.end_round(7).compression["k_max"] == 32  # halved at once


def test_the_controller_starts_below_the_manifests_strength_until_sends_are_measured(config, corpus):
    """R22: the first rounds' messages go out before any send is measured, and at the manifest's
    rank six of them into a 512 kbit/s member were 20 s of its downlink. The controller starts
    two moves (a quarter) below, every message of those rounds at that size, and grows from
    there only as sends are measured; without the controller the manifest's k is sent."""
    policy, link, model = topk_round(config, corpus, "a", 1, controller=True, topk_k=16)
    for r in range(2):  # link.ratio None: nothing measured
        train_round(model, policy, r)
        assert policy.end_round(r).compression["k_max"] == 4
        sent = dilocox_payload.decode_message("a", r, received(r, link.sent[-1][1]))
        assert {e.description["k"] for e in sent.tensors.values()} == {4}
    plain, plain_link, plain_model = topk_round(config, corpus, "a", 1, topk_k=16)
    train_round(plain_model, plain, 0)
    plain.end_round(0)
    sent = dilocox_payload.decode_message("a", 0, received(0, plain_link.sent[-1][1]))
    assert {e.description["k"] for e in sent.tensors.values()} == {16}


def test_controller_off_reports_nothing(config, corpus):
    policy, _, model = topk_round(config, corpus, "a", 1)
    train_round(model, policy, 0)
    assert policy.end_round(0).compression is None


def test_a_message_denser_than_the_manifest_allows_is_refused_with_a_strike(config, corpus):
    sender, sender_link, sender_model = topk_round(config, corpus, "b", 2)
    receiver, link, model = topk_round(config, corpus, "a", 1, delay=0)
    train_round(sender_model, sender, 0)
    sender.end_round(0)
    message = dilocox_payload.decode_message("b", 0, received(0, sender_link.sent[-1][1]))
    honest = dilocox_payload.encode_message(message)
    for name, encoded in message.tensors.items():  # the same message, claiming k = 32 of 64
        message.tensors[name] = Encoded(dict(encoded.description, k=32), encoded.payload)
    link.inbox[0] = [GroupMessage("b", 0, received(0, dilocox_payload.encode_message(message)))]
    train_round(model, receiver, 0)
    outcome = receiver.end_round(0)
    assert link.refusals == [("b", "too_dense")]
    assert len(outcome.refused) == 1 and "density bound 0.25" in outcome.refused[0]
    # the honest message of the same round is accepted
    other, other_link, other_model = topk_round(config, corpus, "c", 3, delay=0)
    other_link.inbox[0] = [GroupMessage("b", 0, received(0, honest))]
    train_round(other_model, other, 0)
    assert other.end_round(0).refused == [] and other_link.refusals == []


def test_the_controllers_choice_reaches_the_status_view_and_the_metrics_record(config, corpus):
    from node.events import RoundEnded
    from node.ops.status import NodeStatus
    from node.ops.status_feed import StatusFeed
    from node.ops.status_view import sections

    policy, _, model = topk_round(config, corpus, "a", 1, controller=True)
    train_round(model, policy, 0)
    outcome = policy.end_round(0)
    event = RoundEnded(round=0, step=H, round_seconds=1.0, outer_seconds=0.1, outcome=outcome,
                       peers_alive=1)
    assert event.record()["compression"]["k_max"] == outcome.compression["k_max"]  # metrics.jsonl
    feed = StatusFeed(NodeStatus(), param_bytes=4, snapshot_sets=1, traffic=lambda: (0, 0),
                      peers_known=lambda: 0)
    feed._round(event)
    assert feed.status.compression == "topk " + outcome.compression["summary"]
    rows = dict(row for _, block in sections(feed.status.to_dict()) for row in block)
    assert rows["controller"] == feed.status.compression


def test_apply_on_arrival_takes_the_step_mid_round_and_shifts_theta(config, corpus):
    """The group's round-0 messages are here at round 1's first step: the outer step is taken
    then, θ moves by exactly what the step moved the round's start, and φ ends where a node
    that waited for the round's end puts it (the same messages, the same order)."""
    early, early_link, early_model = topk_round(config, corpus, "a", 1, apply_on_arrival=True)
    late, late_link, late_model = topk_round(config, corpus, "a", 1, apply_on_arrival=False)
    peer, peer_link, peer_model = topk_round(config, corpus, "b", 2)
    for policy, model in ((early, early_model), (late, late_model), (peer, peer_model)):
        train_round(model, policy, 0)
        policy.end_round(0)
    message = GroupMessage("b", 0, received(0, peer_link.sent[-1][1]))
    early_link.inbox[0], late_link.inbox[0] = [message], [message]
    before_theta = {n: t.detach().clone() for n, t in early_model.named_parameters().items()}
    before_start = early.outer.round_start_weights()
    early.between_steps(1)
    assert early.stepped_round == 1 and early.outer.last_step.senders == ("a", "b")
    after_start = early.outer.round_start_weights()
    for name, theta in early_model.named_parameters().items():
        expected = before_theta[name] + (after_start[name] - before_start[name])
        assert (theta.detach() - expected).abs().max() < 1e-6
    late.between_steps(1)
    assert late.stepped_round == 0  # off: nothing happens mid-round
    for policy, model in ((early, early_model), (late, late_model)):
        train_round(model, policy, 1)
    early_out, late_out = early.end_round(1), late.end_round(1)
    assert early_out.phi_digest == late_out.phi_digest  # one φ, whenever the step was taken
    assert early_out.applied_round == 0 == late_out.applied_round
    assert early_out.stepped_mid_round and not late_out.stepped_mid_round
    assert early_link.digests[-1] == (1, early_out.phi_digest)
    assert early.outer.counters.applied_messages == 2 and early.outer.counters.late == 0
