"""DiLoCoXRound (node/rounds/dilocox/) with real trainers over a scripted link
(tests/round_parts.py): the group's messages a round late, refusals and resyncs, replays after a
missed message, and a node behind its swarm."""

from __future__ import annotations

import math

import torch

from node.rounds.dilocox import payload as dilocox_payload
from node.rounds.dilocox.link import Download, GroupMessage, Replay, SwarmState
from protocol.tensors import weights_digest
from tests.round_parts import config, corpus  # noqa: F401 (fixtures)
from tests.round_parts import H, dilocox, received, train_round


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
    link.resync_due[0] = Download(0, majority["phi"], majority["momentum"])
    train_round(model, a, 1)
    outcome = a.end_round(1)
    assert outcome.resyncs == 1
    assert a.export_state(0)[2] == digest  # a member asking for round 0 is served the majority's
    assert a.agreed[0] == 0  # and a replay would start from it
    # a poisoned resync (its digest won the vote; issue 24): checked as a contribution, refused
    link.resync_due[1] = Download(1, {n: torch.full_like(t, math.nan) for n, t in majority["phi"].items()},
                                  majority["momentum"], "liar")
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
            c_link.resync_due[2] = Replay(  # from the initial state: no check agreed yet
                since=-1, round=2, steps=[(r, *a_link.applied[r]) for r in (0, 1, 2)],
                messages={(0, "b"): sent[("b", 0)]}, digest=outcomes["a"].phi_digest)
    assert outcomes["a"].phi_digest == outcomes["b"].phi_digest == outcomes["c"].phi_digest
    assert outcomes["c"].replays == 1 and outcomes["c"].resyncs == 0 and outcomes["a"].replays == 0
    c, _, c_model = nodes["c"]
    assert c.agreed[0] == 2  # the replayed state: a later replay starts there, whatever the link says
    # records that name the wrong senders: the replay does not reach the majority's φ
    c_link.resync_due[3] = Replay(since=2, round=3, steps=[(3, 2, ("a", "c"))],
                                   messages={}, digest=outcomes["a"].phi_digest)
    # and one from before a round it holds as agreed, whose steps after that are the same wrong ones
    c_link.resync_due[4] = Replay(since=0, round=4, steps=[
        (1, 0, ("a", "b", "c")), (2, 1, ("a", "b", "c")), (3, 2, ("a", "c")), (4, 3, ("a", "c"))],
        messages={}, digest=outcomes["a"].phi_digest)
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
            c_link.resync_due[2] = Replay(since=1, round=2, steps=[(2, *a_link.applied[2])],
                                           messages={}, digest=outcomes["a"].phi_digest)
        if r == 3:  # that replay failed: back to round 0, and the link replays from there
            assert c_link.failed == [(1, 2, 0)] and c.agreed[0] == 0 and c_link.agreed == 0
            assert outcomes["c"].replays == 0
            c_link.resync_due[3] = Replay(
                since=0, round=3, steps=[(r, *a_link.applied[r]) for r in (1, 2, 3)],
                messages={(0, "b"): sent[("b", 0)]}, digest=outcomes["a"].phi_digest)
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
            c_link.resync_due[2] = Replay(  # of round 1, handed over at the step of round 3
                since=-1, round=1, steps=[(r, *a_link.applied[r]) for r in (0, 1)],
                messages={(0, "b"): sent[("b", 0)]}, digest=theirs_of_1)
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
    d[1].resync_due[2] = Replay(since=1, round=2, steps=[(2, 1, ("a", "b"))],
                                 messages={(1, "a"): sent[("a", 1)], (1, "b"): sent[("b", 1)]},
                                 digest=outcomes["a"].phi_digest)
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
    link.catch_ups[0] = SwarmState(6, 5, Download(5, state["phi"], state["momentum"], "s"), "s", digest)
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
        return SwarmState(5, 4, Replay(since=1, round=4, steps=steps, messages=messages,
                                            digest=outcomes["a"].phi_digest), "a",
                          outcomes["a"].phi_digest)
    c_link.catch_ups[1] = swarm_moves_on
    train_round(c_model, c, 1)
    outcome = c.end_round(1)
    assert outcome.phi_digest == theirs_of_1  # round 1's φ, agreed indeed
    assert outcome.caught_up_to == 5 and outcome.replays == 1 and outcome.resyncs == 0
    assert c.phi_digest == outcomes["a"].phi_digest == outcomes["b"].phi_digest
    assert c_link.rejoined == [(2, 5)] and c_model.step == 5 * H and c.agreed[0] == 4
    # a recipe naming the wrong senders: its digest is not reached, and c trains on as it was
    c_link.catch_ups[5] = SwarmState(8, 7, Replay(since=4, round=7, steps=[
        (5, 4, ("c",)), (6, 5, ("c",)), (7, 6, ("c",))], messages={}, digest="0" * 32), "a", "0" * 32)
    c_link.inbox[4] = []
    train_round(c_model, c, 5)
    outcome = c.end_round(5)
    assert outcome.caught_up_to is None and c_link.rejoined == [(2, 5)] and c_model.step == 6 * H


def test_dilocox_a_round_behind_its_swarm_ends_at_its_next_step(config, corpus):
    """The link says a majority finished the round after round 1 while this node trains round 1:
    the round ends after its next step (the steps that would have made its message late are
    skipped, reported), its message is sent as round 1's, and round 2 is whole again."""
    a, link, model = dilocox(config, corpus, "a", 1)
    link.swarm_round = 3  # a majority finished round 2 while we train round 1
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
