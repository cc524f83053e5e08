"""Members whose clocks differ: two real daemons, one of them 60 s behind, pair and exchange.

libfaketime (Debian's `faketime` package) shifts the wall clock of one node's Python process;
its monotonic clock is left alone, and p2pd, a statically linked Go binary, keeps the real time.
So the skewed node stamps its member records, its DHT storage and its messages 60 s behind,
as a volunteer whose clock was never set would. Each node sees the other as 60 s off, one
ahead and one behind.

The nodes run until each has paired with the other over more than a member record's TTL: each
view then lives on heartbeats that a clock 60 s off wrote and a DHT node 60 s off stored, not
on the first record it saw. Neither node stops on its own: one that finished first would leave,
and its partner would rightly see its tombstone and train alone.
"""

from pathlib import Path

import pytest

from node.config.settings import NodeSettings
from tests.swarm_harness import small_manifest

pytestmark = pytest.mark.integration
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW_S = 60
PAIRED_ROUNDS = 4


def joined(events: list[dict]) -> bool:
    return any(e["event"] == "joined" for e in events)


def paired_with(events: list[dict], peer: str) -> list[dict]:
    return [e for e in events if e["event"] == "round" and e["partner"] == peer]


def paired_past_a_ttl(peer: str):
    """The predicate: PAIRED_ROUNDS rounds paired with `peer`, the last more than a member
    record's TTL after the first (times on the node's own clock, so a skew cancels out)."""
    def predicate(events: list[dict]) -> bool:
        paired = paired_with(events, peer)
        return len(paired) >= PAIRED_ROUNDS and paired[-1]["time"] - paired[0]["time"] > NodeSettings.member_ttl_s
    return predicate


@pytest.mark.skipif(not LIBFAKETIME.exists(), reason="libfaketime is not installed (apt-get install faketime)")
def test_two_nodes_whose_clocks_differ_by_60_s_pair_and_exchange(harness_factory):
    harness = harness_factory(small_manifest("t-skew", "noloco"))
    first = harness.start_node(0, extra=["--min-peers", "1"])
    first.wait_for(joined, 90, "joining")
    behind = harness.start_node(1, [first.address], env={
        "LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": f"-{SKEW_S}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    behind.wait_for(joined, 90, "joining")
    # the skew is real: the second node joined after the first, by a clock a minute behind
    assert behind.events("joined")[-1]["time"] < first.events("joined")[-1]["time"] - SKEW_S / 2
    pairs = ((first, behind), (behind, first))
    for node, other in pairs:
        node.wait_for(paired_past_a_ttl(other.peer_id), 180,
                      f"{PAIRED_ROUNDS} rounds paired with the skewed node over more than a TTL")
    # the last event each node logged before either stopped (on its own clock): after that, the
    # first to stop leaves and its partner rightly trains alone
    stopping = {node.index: node.events()[-1]["time"] for node in (first, behind)}
    for node in (first, behind):
        assert harness.stop(node) == 0, node.log_tail()
    for node, other in pairs:
        rounds = [r for r in node.events("round") if r["time"] <= stopping[node.index]]
        paired = paired_with(rounds, other.peer_id)
        assert {r["partner"] for r in rounds if r["partner"]} == {other.peer_id}, rounds
        assert all(r["pair_shift"] > 0 for r in paired), paired
        # from the first pairing on, the other node never left this node's view
        assert all(r["peers_alive"] >= 1 for r in rounds if r["round"] >= paired[0]["round"]), rounds
        assert not [r["refused"] for r in rounds if r.get("refused")]
        counters = node.events("transport")[-1]
        assert "EXPIRED" not in counters["refused_incoming"], counters
