"""A first join that cannot split the swarm (NoLoCo, loopback, real p2pd).

Two members train a few rounds; a fresh node then joins through --peer while its DHT answers
slowly: run through tests/adversary.py's `slow-members` (a fault, not an adversary), its
member lookups answer "no member" for their first seconds although the members' records are
stored, longer than the single look (`first_members_s`) a node given no peer takes. Asserted
from what the joiner writes: its lookups found the records hidden (the fault took effect), it
never trained a round of its own, and it started from a member's state, whose φ digest that
member had announced.

A node stopped (SIGTERM) while it is still joining leaves there with exit 0: its join is held
open by the same fault, hiding the members for longer than the test runs, so the stop always
comes mid-join; joining on regardless, it would have waited out `join_members_s` and failed
(exit 1), as a home stopped mid-download did when the members serving its state left with it.
"""

import pytest

from tests.faults import FaultHarness, has, joined, stop_all
from tests.swarm_harness import small_manifest

pytestmark = pytest.mark.integration
SLOW_S = 8.0  # > first_members_s (2 s), < join_members_s


def test_a_joiner_whose_dht_answers_slowly_takes_the_swarms_state(harness_factory):
    harness = harness_factory(small_manifest("t-first-join", "noloco"), harness_class=FaultHarness)
    extra = ["--min-peers", "1"]
    first = harness.start_node(0, extra=extra)
    first.wait_for(joined, 90, "joining")
    second = harness.start_node(1, [first.address], extra)
    members = [first, second]
    for node in members:  # past max_staleness (2): a joiner at round 0 could pair with nobody
        node.wait_rounds(4, timeout=120)
    joiner = harness.start_node(2, [first.address], adversary="slow-members",
                                env={"LOWCOMM_TEST_SLOW_MEMBERS_S": str(SLOW_S)})
    events = joiner.wait_for(has("late_join"), 120, "the joiner to start from a member's state")
    late = next(e for e in events if e["event"] == "late_join")
    log = joiner.log_tail(100_000)
    hidden = [line for line in log.splitlines() if "adversary: member lookup answered no member" in line]
    assert any("(0 stored)" not in line for line in hidden), log[-3000:]  # members were there
    source = next(node for node in members if node.peer_id == late["source"])
    announced = {e["phi_digest"] for e in source.events() if e.get("phi_digest")}
    assert late["digest"] in announced, (late, log[-3000:])
    assert late["round"] >= 4, late
    joiner.wait_rounds(1, timeout=90)
    assert min(r["round"] for r in joiner.events("round")) >= late["round"]  # no round of its own
    assert stop_all([*members, joiner]) == [0, 0, 0]


def test_a_node_stopped_while_joining_leaves_at_once_with_exit_0(harness_factory):
    harness = harness_factory(small_manifest("t-stopped-joining", "noloco"), harness_class=FaultHarness)
    member = harness.start_node(0)
    member.wait_for(joined, 90, "joining")
    joiner = harness.start_node(1, [member.address], adversary="slow-members",
                                env={"LOWCOMM_TEST_SLOW_MEMBERS_S": "3600"})  # hidden all along
    joiner.wait_log("adversary: member lookup answered no member", 90)  # in its join, waiting
    assert stop_all([joiner]) == [0], joiner.log_tail()
    assert "stopped while joining: leaving before training" in joiner.log_tail(100_000)
    kinds = {e["event"] for e in joiner.events()}
    assert {"joined", "left"} <= kinds and not kinds & {"late_join", "started", "step"}, kinds
    assert stop_all([member]) == [0], member.log_tail()
