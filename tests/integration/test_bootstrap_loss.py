"""The member everyone bootstrapped from dies: the others keep seeing each other and exchanging.

Real daemons (tiny NoLoCo, loopback, each its own p2pd): every node but the first bootstrapped
from the first, which is then SIGKILLed. The survivors must go on pairing with each other,
reaching each other through the DHT and the addresses their member records carry, not only
through the bootstrap peer they were given.
"""

import signal

import pytest

from tests.swarm_harness import small_manifest

pytestmark = pytest.mark.integration


def rounds_paired_with(node, others: set[str], after: float) -> int:
    return sum(1 for r in node.events("round") if r["time"] > after and r["partner"] in others)


@pytest.mark.parametrize("count", [3])
def test_survivors_of_the_bootstrap_members_death_keep_pairing(harness_factory, count):
    harness = harness_factory(small_manifest(f"t-boot{count}", "noloco"))
    nodes = harness.start(count)
    bootstrap, survivors = nodes[0], nodes[1:]
    for node in survivors:  # the swarm runs: each survivor has paired at least once
        node.wait_for(lambda ev: any(e["event"] == "round" and e["partner"] for e in ev), 180,
                      "a first paired round")
    harness.kill(bootstrap, signal.SIGKILL)
    killed_at = max(e["time"] for node in survivors for e in node.events())
    ids = {node.peer_id for node in survivors}
    for node in survivors:
        others = ids - {node.peer_id}
        node.wait_for(lambda ev: rounds_paired_with(node, others, killed_at) >= 3, 240,
                      "three rounds paired with another survivor after the bootstrap member died")
    for node in survivors:
        assert node.process.poll() is None, f"node {node.index} exited:\n{node.log_tail()}"
