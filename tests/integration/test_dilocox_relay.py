"""Issue 18 on real daemons: a DiLoCoX swarm larger than its fan-out. Each message is pushed to
2 of the 3 other members; the third fetches it from one of them (node/rounds/dilocox/relay.py),
checked against its author's signature, so every member applies the same messages and φ stays
one, where it split every round by design before. Separate processes, real p2pd, loopback."""

import pytest

from tests.swarm_harness import DILOCOX_BENIGN, assert_one_phi, run_to_the_end, small_manifest

pytestmark = pytest.mark.integration


def test_a_swarm_beyond_its_fan_out_fetches_what_was_not_sent_to_it_and_holds_one_phi(harness_factory):
    m = small_manifest("t-dilocox-relay", "dilocox", rank=4, fan_out=2)
    nodes = run_to_the_end(harness_factory(m), 4, 160)
    # the step applying the first round may split: a node joining after a member's first push
    # has no holder to ask before its own round ends
    assert_one_phi(nodes, min_rounds=5)
    relayed = [node.events("relayed") for node in nodes]
    for node, fetched in zip(nodes, relayed):
        assert fetched, f"node {node.index} fetched no message it was not sent"
        rounds = node.events("round")
        # its outer steps applied every member's message, fetched ones included
        assert sum(len(r["group"]) == 4 for r in rounds) >= len(rounds) - 2, \
            [r["group"] for r in rounds]
        counters = node.events("transport")[-1]
        assert set(counters["refused_incoming"]) <= DILOCOX_BENIGN, counters["refused_incoming"]
