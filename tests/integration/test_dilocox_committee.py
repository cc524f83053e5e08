"""Issue 18 on real daemons: a DiLoCoX committee of senders (protocol/committee.py). Four nodes,
about two senders a round, each serving two rounds in a row (a tenure shorter than the
manifest's 8, so that a run of 10 rounds sees several terms): a member not drawn for a round
sends nothing and keeps its work for its next message, the others wait only for the drawn
members, and φ stays one. Separate processes, real p2pd, loopback."""

import pytest

from protocol.committee import send_share, sends
from tests.swarm_harness import DILOCOX_BENIGN, assert_one_phi, run_to_the_end, small_manifest

pytestmark = pytest.mark.integration


def test_a_committee_sends_in_its_rounds_only_and_the_swarm_holds_one_phi(harness_factory):
    m = small_manifest("t-dilocox-committee", "dilocox", rank=4, senders=2, senders_tenure=2)
    nodes = run_to_the_end(harness_factory(m), 4, 200)
    common = assert_one_phi(nodes, min_rounds=6)
    share, tenure = send_share(2, 4), m.protocol.senders_tenure
    # from the second round all four ended to the one before the last: a node whose view of the
    # swarm was not whole yet, or no longer (members leaving at the end), drew from a smaller
    # swarm (at 2 or fewer, everyone sends; a CI run: a node alone in its last round sent)
    settled, last = common[1], common[-1]
    sent_in, sat_out = 0, 0  # node-rounds: a committee, neither everyone nor no one
    for node in nodes:
        rounds = [r for r in node.events("round") if settled <= r["round"] < last]
        sent = {r["round"] for r in rounds if r["sent_bytes"] > 0}
        drawn = {r["round"] for r in rounds if sends(node.peer_id, r["round"], share, tenure)}
        assert sent == drawn, (node.index, sorted(sent), sorted(drawn))
        sent_in, sat_out = sent_in + len(sent), sat_out + len(rounds) - len(sent)
        # each outer step applied the messages of members drawn for its round, and no others
        for r in rounds:
            if r["applied_round"] is not None and settled <= r["applied_round"] < last:
                assert all(sends(p, r["applied_round"], share, tenure) for p in r["group"]), r
        counters = node.events("transport")[-1]
        assert set(counters["refused_incoming"]) <= DILOCOX_BENIGN, counters["refused_incoming"]
    assert sent_in > 0 and sat_out > 0, (sent_in, sat_out)
