"""Members whose clocks differ: two real daemons, one of them 60 s behind, pair and exchange.

libfaketime (Debian's `faketime` package) shifts the wall clock of one node's Python process;
its monotonic clock is left alone, and p2pd, a statically linked Go binary, keeps the real time.
So the skewed node stamps its member records, its DHT storage and its messages 60 s behind,
as a volunteer whose clock was never set would.
"""

from pathlib import Path

import pytest

from tests.swarm_harness import left, small_manifest

pytestmark = pytest.mark.integration
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW_S = 60


def joined(events: list[dict]) -> bool:
    return any(e["event"] == "joined" for e in events)


@pytest.mark.skipif(not LIBFAKETIME.exists(), reason="libfaketime is not installed (apt-get install faketime)")
@pytest.mark.xfail(reason="open: both nodes join, pair and swap once, then the node 60 s behind sees no member "
                          "(0 alive / 0 known) from its third round on while the other still sees it; not "
                          "diagnosed yet (the in-process test of skewed records passes)")
def test_two_nodes_whose_clocks_differ_by_60_s_pair_and_exchange(harness_factory):
    harness = harness_factory(small_manifest("t-skew", "noloco"))
    extra = ["--max-steps", "120"]
    first = harness.start_node(0, extra=[*extra, "--min-peers", "1"])
    first.wait_for(joined, 90, "joining")
    behind = harness.start_node(1, [first.address], extra, env={
        "LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": f"-{SKEW_S}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    behind.wait_for(joined, 90, "joining")
    # the skew is real: the second node joined after the first, by a clock a minute behind
    assert behind.events("joined")[-1]["time"] < first.events("joined")[-1]["time"] - SKEW_S / 2
    for node in (first, behind):
        node.wait_for(left, 300, "the node to finish and leave")
        assert node.process.wait(timeout=30) == 0
    for node, other in ((first, behind), (behind, first)):
        rounds = node.events("round")
        partners = [r["partner"] for r in rounds if r["partner"]]
        # 6 rounds: the first may end before the other node is seen; every later one pairs
        assert len(partners) >= 4 and set(partners) == {other.peer_id}, rounds
        assert all(r["pair_shift"] > 0 for r in rounds if r["partner"]), rounds
        assert not [r["refused"] for r in rounds if r.get("refused")]
        counters = node.events("transport")[-1]
        assert "EXPIRED" not in counters["refused_incoming"], counters
