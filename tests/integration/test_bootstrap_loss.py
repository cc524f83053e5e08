"""The member everyone bootstrapped from dies: the others keep seeing each other and exchanging.

Real daemons (tiny NoLoCo, loopback, each its own p2pd), in swarms of 3 and of 6: every node but
the first bootstrapped from the first, which is then SIGKILLed. The survivors must go on pairing
with each other, and each must keep every other survivor in its view once the dead member's
record has expired from it, reaching them through the DHT and the addresses their member
records carry, not only through the bootstrap peer they were given.
"""

import signal

import pytest

from node.config.settings import NodeSettings
from tests.swarm_harness import small_manifest

pytestmark = pytest.mark.integration
PAIRED_AFTER = 3  # rounds each survivor pairs with another survivor after the death


def rounds_paired_with(events: list[dict], others: set[str], after: float) -> int:
    return sum(1 for e in events if e["event"] == "round" and e["time"] > after and e["partner"] in others)


def sees_the_survivors(events: list[dict], survivors: int, after: float) -> bool:
    """A round ended more than a member record's TTL after the death with every other survivor
    alive in this node's view, and the dead member no longer in it."""
    return any(e["event"] == "round" and e["time"] > after + NodeSettings.member_ttl_s
               and e["peers_alive"] == survivors - 1 for e in events)


@pytest.mark.parametrize("count", [3, 6])
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
        node.wait_for(lambda ev: rounds_paired_with(ev, others, killed_at) >= PAIRED_AFTER
                      and sees_the_survivors(ev, len(survivors), killed_at), 240,
                      f"{PAIRED_AFTER} rounds paired with other survivors after the bootstrap member "
                      f"died, and a view of all {len(survivors) - 1} others")
    for node in survivors:
        assert node.process.poll() is None, f"node {node.index} exited:\n{node.log_tail()}"
        # never alone: survivors that reached each other only through the dead member lose
        # each other from their views and redial for a minute or more
        after = [r["peers_alive"] for r in node.events("round") if r["time"] > killed_at]
        assert min(after) >= 1, f"node {node.index} saw no other member after the death: {after}"
