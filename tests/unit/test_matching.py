"""NoLoCo's asynchronous random matching (protocol/matching.py): invariants I1-I6 and the rules."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ConfigurationError, ProtocolError
from protocol.matching import (DeclineReason, MatchingState, MessageKind, ReadyAnnouncement,
                               catch_up_round, is_eligible, match_round)

MANIFEST = "manifest-a"


def swarm(rounds: dict[str, int], manifests: dict[str, str] | None = None, staleness: int = 2):
    manifests = manifests or {}
    states = {n: MatchingState(n, manifests.get(n, MANIFEST), r, staleness) for n, r in rounds.items()}
    announcements = [ReadyAnnouncement(n, s.manifest_digest, s.round_index) for n, s in states.items()]
    return states, announcements


def assert_consistent(states, pairs):
    for node, pair in pairs.items():
        if pair is None:
            continue
        assert pair.partner != node                                   # no self-pairing (I2)
        other = pairs[pair.partner]
        assert other is not None and other.partner == node            # same pair on both sides (I4)
        assert pair.initiator == other.initiator == min(node, pair.partner)
        assert pair.partner_round == states[pair.partner].round_index
        a, b = states[node], states[pair.partner]
        assert is_eligible(node, a.manifest_digest, a.round_index, b.node_id, b.manifest_digest,
                           b.round_index, a.max_staleness)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["m1", "m2"])), min_size=1, max_size=14),
       st.integers(0, 2**32 - 1), st.booleans())
def test_random_swarms_keep_every_invariant(nodes, seed, shuffle):
    rounds = {f"n{i:02d}": r for i, (r, _) in enumerate(nodes)}
    manifests = {f"n{i:02d}": m for i, (_, m) in enumerate(nodes)}
    states, announcements = swarm(rounds, manifests)
    pairs = match_round(states, announcements, random.Random(seed),
                        random.Random(seed + 1) if shuffle else None)
    assert_consistent(states, pairs)
    # Every proposal was answered: nothing in flight, nothing deferred.
    assert all(s.outstanding is None for s in states.values())
    # Maximal: no two unpaired nodes that could have paired are left (the deferral rule).
    unpaired = [n for n, p in pairs.items() if p is None]
    for a in unpaired:
        for b in unpaired:
            assert not states[a].eligible(b, states[b].manifest_digest, states[b].round_index)
    # Ending the round counts it and starts the next one clean (I1 is per round).
    for node, state in states.items():
        outcome = state.end_round()
        assert outcome.pair == pairs[node] and outcome.outgoing == ()
        assert state.pair is None and state.round_index == rounds[node] + 1


def test_at_most_one_pair_per_round_and_partner_fixed_until_end_of_round():
    states, announcements = swarm({"a": 0, "b": 0, "c": 0, "d": 0})
    pairs = match_round(states, announcements, random.Random(3))
    assert_consistent(states, pairs)
    assert all(p is not None for p in pairs.values())  # 4 nodes, all eligible: two pairs
    a = states["a"]
    partner = a.pair.partner
    stranger = next(n for n in "bcd" if n != partner)
    reply = a.handle(states[stranger]._message(MessageKind.PROPOSE, "a", 0))
    assert [m.kind for m in reply] == [MessageKind.DECLINE]
    assert reply[0].reason is DeclineReason.PAIRED and a.pair.partner == partner
    assert a.choose_candidate(announcements, random.Random(0)) is None


def test_no_self_pairing_even_when_alone():
    states, announcements = swarm({"solo": 0})
    assert match_round(states, announcements, random.Random(0)) == {"solo": None}
    assert states["solo"].end_round().pair is None
    assert states["solo"].counters.rounds_unpaired == 1


@pytest.mark.parametrize("gap, pairs_expected", [(0, True), (2, True), (3, False)])
def test_staleness_bound(gap, pairs_expected):
    states, announcements = swarm({"old": 5, "new": 5 + gap})
    pairs = match_round(states, announcements, random.Random(0))
    assert (pairs["old"] is not None) == pairs_expected
    assert_consistent(states, pairs)


def test_staleness_is_a_setting_and_is_checked_by_the_acceptor_too():
    states, announcements = swarm({"a": 0, "b": 4}, staleness=4)
    assert match_round(states, announcements, random.Random(0))["a"].partner == "b"
    strict = MatchingState("b", MANIFEST, 4, max_staleness=1)
    stale = MatchingState("a", MANIFEST, 0, max_staleness=9)
    proposal = stale.choose_candidate([ReadyAnnouncement("b", MANIFEST, 4)], random.Random(0))
    (reply,) = strict.handle(proposal)
    assert reply.kind is MessageKind.DECLINE and reply.reason is DeclineReason.INELIGIBLE


def test_other_manifests_never_pair():
    states, announcements = swarm({"a": 0, "b": 0}, {"a": "m1", "b": "m2"})
    assert match_round(states, announcements, random.Random(0)) == {"a": None, "b": None}
    forged = MatchingState("b", "m2").handle(
        MatchingState("a", "m1").choose_candidate([ReadyAnnouncement("b", "m1", 0)], random.Random(0)))
    assert forged[0].reason is DeclineReason.INELIGIBLE


@pytest.mark.parametrize("first_delivered", ["a", "b"])
def test_simultaneous_proposals_make_one_pair(first_delivered):
    a, b = MatchingState("a", MANIFEST), MatchingState("b", MANIFEST)
    to_b = a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 0)], random.Random(0))
    to_a = b.choose_candidate([ReadyAnnouncement("a", MANIFEST, 0)], random.Random(0))
    order = [(a, to_a), (b, to_b)] if first_delivered == "a" else [(b, to_b), (a, to_a)]
    replies = [m for state, msg in order for m in state.handle(msg)]
    assert [m.kind for m in replies] == [MessageKind.ACCEPT, MessageKind.ACCEPT]
    for reply in replies:  # each side then receives the other's accept: agreed, not an error
        assert {"a": a, "b": b}[reply.recipient].handle(reply) == []
    assert a.pair.partner == "b" and b.pair.partner == "a"
    assert a.pair.initiator == b.pair.initiator == "a"
    assert a.counters.ignored == b.counters.ignored == 0


def test_accept_arriving_before_the_crossing_proposal_keeps_one_pair():
    a, b = MatchingState("b2", MANIFEST), MatchingState("a1", MANIFEST)
    to_b = a.choose_candidate([ReadyAnnouncement("a1", MANIFEST, 0)], random.Random(0))
    to_a = b.choose_candidate([ReadyAnnouncement("b2", MANIFEST, 0)], random.Random(0))
    (accept_from_b,) = b.handle(to_b)          # b sees the crossing proposal first: pairs
    assert a.handle(accept_from_b) == []       # a learns of it by b's accept ...
    (again,) = a.handle(to_a)                  # ... before b's own proposal arrives
    assert again.kind is MessageKind.ACCEPT and a.pair.partner == "a1" and b.pair.partner == "b2"
    assert a.pair.initiator == b.pair.initiator == "a1"


def test_a_cycle_of_proposals_still_pairs_by_deferring_to_smaller_ids():
    states = {n: MatchingState(n, MANIFEST) for n in "abc"}
    cycle = {"a": "b", "b": "c", "c": "a"}
    wave = [states[n].choose_candidate([ReadyAnnouncement(t, MANIFEST, 0)], random.Random(0))
            for n, t in cycle.items()]
    while wave:
        wave = [reply for msg in wave for reply in states[msg.recipient].handle(msg)]
    partners = {n: s.pair.partner if s.pair else None for n, s in states.items()}
    assert partners == {"a": "c", "b": None, "c": "a"}
    assert states["a"].counters.deferred == 1


def test_a_decline_frees_the_proposer_to_try_another_and_never_the_same_peer_twice():
    a = MatchingState("a", MANIFEST)
    peers = [ReadyAnnouncement(n, MANIFEST, 0) for n in ("b", "c")]
    first = a.choose_candidate(peers, random.Random(1))
    assert a.choose_candidate(peers, random.Random(1)) is None  # one proposal in flight (I3)
    busy = MatchingState(first.recipient, MANIFEST)
    busy.choose_candidate([ReadyAnnouncement("z", MANIFEST, 0)], random.Random(0))
    (decline,) = busy.handle(first)  # busy with z and "a" is the smaller id: declined
    assert decline.reason is DeclineReason.BUSY
    assert a.handle(decline) == [] and a.wants_partner
    second = a.choose_candidate(peers, random.Random(1))
    assert second.recipient != first.recipient
    assert a.choose_candidate(peers, random.Random(1)) is None and a.counters.proposals_sent == 2


def test_late_and_unsolicited_replies_are_ignored_counted_and_accepts_cancelled():
    a = MatchingState("a", MANIFEST)
    proposal = a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 0)], random.Random(0))
    outcome = a.end_round()  # proposal abandoned at the deadline
    assert outcome.pair is None and a.round_index == 1
    (late_accept,) = MatchingState("b", MANIFEST).handle(proposal)
    (cancel,) = a.handle(late_accept)  # I6: b holds a pair a does not
    assert (cancel.kind, cancel.recipient, cancel.proposal_round) == (MessageKind.CANCEL, "b", 0)
    assert a.pair is None and a.counters.ignored == 1 and a.counters.cancels_sent == 1
    stray = MatchingState("c", MANIFEST, 1)._message(MessageKind.ACCEPT, "a", 1)
    (cancel,) = a.handle(stray)
    assert cancel.kind is MessageKind.CANCEL and a.pair is None and a.counters.ignored == 2
    late_decline = MatchingState("d", MANIFEST)._message(MessageKind.DECLINE, "a", 0)
    assert a.handle(late_decline) == [] and a.counters.ignored == 3


def test_an_accept_that_lands_after_the_proposers_round_ended_is_undone_and_both_pair_again():
    """The half-formed pair of the soak: b accepted, a's round ended first. a's cancel frees b,
    which then pairs with c in the same round; the pairs seen on both sides agree (I4)."""
    a, b, c = (MatchingState(n, MANIFEST) for n in "abc")
    proposal = a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 0)], random.Random(0))
    a.end_round()
    (accept,) = b.handle(proposal)
    assert b.pair.partner == "a" and not b.wants_partner
    (cancel,) = a.handle(accept)
    assert b.handle(cancel) == [] and b.pair is None and b.wants_partner
    assert b.counters.pairs_cancelled == 1
    states = {"b": b, "c": c}
    pairs = match_round(states, [ReadyAnnouncement(n, MANIFEST, 0) for n in "bc"], random.Random(0))
    assert pairs["b"].partner == "c" and pairs["c"].partner == "b"
    assert_consistent(states, pairs)


def test_a_stale_cancel_never_undoes_a_pair_both_sides_hold():
    a, b = MatchingState("a", MANIFEST), MatchingState("b", MANIFEST)
    old = a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 0)], random.Random(0))
    a.end_round()
    (old_accept,) = b.handle(old)
    # a, now in round 1, proposes to b again before b's old accept reaches it; b agrees
    new = a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 0)], random.Random(0))
    (new_accept,) = b.handle(new)
    assert a.handle(new_accept) == [] and a.pair.partner == "b" and b.pair.partner == "a"
    # the old accept lands at a paired with b: no cancel, the pair stands on both sides
    assert a.handle(old_accept) == [] and a.pair.partner == "b"
    # a cancel of the old proposal (had one been sent) no longer matches b's pair
    stale = a._message(MessageKind.CANCEL, "b", old.proposal_round)
    assert b.handle(stale) == [] and b.pair.partner == "a" and b.counters.pairs_cancelled == 0
    # a cancel from anyone but the partner is ignored too
    assert b.handle(MatchingState("c", MANIFEST)._message(MessageKind.CANCEL, "b", 0)) == []
    assert b.pair.partner == "a"


def test_a_partner_that_refused_our_swap_as_not_paired_frees_us():
    a, b = MatchingState("a", MANIFEST), MatchingState("b", MANIFEST)
    b.handle(a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 0)], random.Random(0)))
    assert not b.drop_pair("c") and b.pair.partner == "a"
    assert b.drop_pair("a") and b.pair is None and b.wants_partner


def test_end_round_declines_deferred_proposals():
    a = MatchingState("a", MANIFEST)
    a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 0)], random.Random(0))
    proposal_from_c = MatchingState("c", MANIFEST).choose_candidate(
        [ReadyAnnouncement("a", MANIFEST, 0)], random.Random(0))
    assert a.handle(proposal_from_c) == []  # deferred: c > a
    outcome = a.end_round()
    assert [(m.recipient, m.reason) for m in outcome.outgoing] == [("c", DeclineReason.ROUND_ENDED)]


def test_partners_vary_over_rounds():
    nodes = [f"node-{i}" for i in range(8)]
    states = {n: MatchingState(n, MANIFEST) for n in nodes}
    rng = random.Random(7)
    seen = {n: set() for n in nodes}
    for _ in range(12):
        announcements = [ReadyAnnouncement(n, MANIFEST, s.round_index) for n, s in states.items()]
        pairs = match_round(states, announcements, rng)
        assert_consistent(states, pairs)
        for n, pair in pairs.items():
            if pair is not None:
                seen[n].add(pair.partner)
        for s in states.values():
            s.end_round()
    assert all(len(partners) >= 4 for partners in seen.values()), seen


def test_bad_settings_and_misrouted_messages_are_refused():
    with pytest.raises(ConfigurationError, match="max_staleness"):
        MatchingState("a", MANIFEST, max_staleness=-1)
    with pytest.raises(ConfigurationError, match="node_id"):
        MatchingState("", MANIFEST)
    a = MatchingState("a", MANIFEST)
    with pytest.raises(ProtocolError, match="handed to"):
        a.handle(MatchingState("b", MANIFEST)._message(MessageKind.PROPOSE, "c", 0))
    with pytest.raises(ProtocolError, match="must change"):
        a.end_round(next_round=0)
    with pytest.raises(ProtocolError, match="must change"):
        a.end_round(next_round=-3)


def test_an_ineligible_accept_counts_as_a_decline_and_repeated_proposals_wait_once():
    a = MatchingState("a", MANIFEST, 5)
    proposal = a.choose_candidate([ReadyAnnouncement("b", MANIFEST, 5)], random.Random(0))
    forged = MatchingState("b", MANIFEST, 9)._message(MessageKind.ACCEPT, "a", proposal.proposal_round)
    assert a.handle(forged) == [] and a.pair is None and a.wants_partner
    assert a.counters.ignored == 1 and a.counters.declines_received == 1

    busy = MatchingState("m", MANIFEST)
    busy.choose_candidate([ReadyAnnouncement("c", MANIFEST, 0)], random.Random(0))
    again = MatchingState("z", MANIFEST).choose_candidate([ReadyAnnouncement("m", MANIFEST, 0)],
                                                          random.Random(0))
    assert busy.handle(again) == [] and busy.handle(again) == []
    (accept,) = busy.handle(MatchingState("c", MANIFEST)._message(
        MessageKind.DECLINE, "m", 0, DeclineReason.PAIRED))
    assert accept.kind is MessageKind.ACCEPT and accept.recipient == "z" and busy.pair.partner == "z"


@pytest.mark.parametrize("next_round, peers, expected", [
    (1, [16, 15, 17], 16),      # the soak's first node: 15 rounds behind everyone
    (1, [3, 3], None),          # within max_staleness (2) of the swarm: no jump
    (1, [4, 4], 4),             # one round beyond it
    (10, [4, 5, 6], 6),         # ahead of the swarm: back to it (it would pair with nobody)
    (20, [10, 11], 11),         # the CI run's cut link: one node ahead of two
    (8, [4, 5, 6], None),       # ahead within max_staleness: no jump
    (1, [4, 5, 10**9], 5),      # one liar (or one fast node) does not pull the node forward
    (1, [10**9, 10**9, 3], 10**9),  # a majority does
    (1, [20, 5], 5),            # two peers: the lower of them
    (5, [1, 10**9], None),      # one liar each way: the median is this node
    (1, [], None),              # alone
])
def test_a_node_out_of_step_with_its_swarm_moves_to_the_median_round(next_round, peers, expected):
    assert catch_up_round(next_round, peers, max_staleness=2) == expected
    if expected is not None:  # a peer's round: after the jump the node is eligible with it
        assert is_eligible("me", MANIFEST, expected, "peer", MANIFEST, expected, 2) and expected in peers


@pytest.mark.parametrize("rounds", [[0, 15], [3, 3, 30], [0, 9, 20], [1, 2, 40, 41], [7, 50, 51, 52, 90]])
def test_every_node_moves_to_the_same_round_so_none_is_left_out(rounds):
    """Each node computes the swarm's round from the others' and its own: the same value, so
    after one round's end every node is within max_staleness of every other (two nodes apart
    never swap places, which a target of the other's round would make them do)."""
    after = []
    for i, own in enumerate(rounds):
        target = catch_up_round(own, rounds[:i] + rounds[i + 1:], max_staleness=2)
        after.append(own if target is None else target)
    assert max(after) - min(after) <= 2 * 2, (rounds, after)
    median = sorted(rounds)[len(rounds) // 2]
    assert all(abs(r - median) <= 2 for r in after), (rounds, after)
