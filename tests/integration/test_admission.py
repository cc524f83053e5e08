"""Issue 8, admission: in an allowlist swarm every member refuses an unlisted key.

The outsider is a real daemon run through tests/adversary.py with its own allowlist check
skipped (a node that plays by the rules stops before joining, see node/daemon/join.py); everything
else is the product: the members' transports refuse its streams NOT_ADMITTED, their member
views leave it out, and the outsider stops with one sentence naming its key.
"""

import pytest

from p2p.identity import NodeIdentity, identity_path
from tests.faults import FaultHarness, adversary_manifest, joined, stop_all, wait_exit

pytestmark = pytest.mark.integration


def test_every_member_refuses_an_unlisted_key_which_stops_with_one_sentence(harness_factory):
    keys = [NodeIdentity.generate() for _ in range(2)]
    m = adversary_manifest("t-admission")
    m.admission.mode, m.admission.public_keys = "allowlist", [k.peer_id.to_base58() for k in keys]
    harness = harness_factory(m, harness_class=FaultHarness)
    for i, key in enumerate(keys):
        key.save(identity_path(harness.base / f"node-{i}"))
    members = harness.start(2)
    for node in members:  # a running swarm: the outsider joins late and asks for the state
        node.wait_rounds(1, timeout=60)
    # it bootstraps from one member and learns the other from the DHT: it asks both
    outsider = harness.start_node(2, [members[0].address], adversary="unlisted")
    outsider.wait_for(joined, 90, "the outsider to join the DHT")
    assert wait_exit(outsider, 120) == 1
    log = outsider.log_tail(100_000)
    assert "adversary: skipping the allowlist check" in log
    assert log.strip().splitlines()[-1] == (
        f"lowcomm-node: error: all 2 members asked of swarm 't-admission' refused this node: its "
        f"key {outsider.peer_id} is not on the swarm's allowlist; send it to the swarm's "
        f"operator to be added"), log[-2000:]
    # the members go on training together, and never took the outsider as a partner
    for node in members:
        node.wait_rounds(len(node.events("round")) + 2, timeout=60)
    assert stop_all(members) == [0, 0]
    for node in members:
        assert node.events("transport")[-1]["refused_incoming"].get("NOT_ADMITTED", 0) >= 1
        rounds = node.events("round")
        assert all(r.get("partner") != outsider.peer_id for r in rounds)
        assert any(r.get("partner") for r in rounds), "the members should pair with each other"
