"""A NoLoCo swap on a slow but live link is not cut at a fixed time (p2p/progress.py): two `join`
daemons, one behind a 500 kbit/s link (tbf, tests/netns_link.py), swap fp32 snapshots of about
460 kB each way, about 7.5 s a swap: nearly twice the swarm's pair_deadline_s of 4 s, at which
the swap used to be cut whatever its size ("did not complete within 4 s"). Overlap timing: the
swap may outlast its round by max_swap_rounds rounds, and ends only if it stalls or could not
land within them at the swarm's declared minimum link rate (0.25 Mbit/s here). Blocking timing:
pair_deadline_s bounds the wait for a partner, not the swap under way, which ends by the same
rules (its need-by: its bytes at that rate)."""

from __future__ import annotations

import pytest

from tests import netns_link
from tests.faults import FaultHarness, has
from tests.swarm_harness import small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.host_network]  # a veth pair on the host
PAIR_DEADLINE_S = 4.0
LINK = "500kbit"


@pytest.mark.skipif(netns_link.available() is not None, reason=str(netns_link.available()))
@pytest.mark.parametrize("timing", ["overlap", "blocking"])
def test_a_noloco_swap_twice_as_long_as_pair_deadline_completes_while_bytes_move(harness_factory, timing):
    m = small_manifest(f"t-slow-swap-{timing}", "noloco", inner_steps=4, timing=timing,
                       pair_deadline_s=PAIR_DEADLINE_S, max_swap_rounds=4, min_link_mbit_s=0.25)
    m.protocol.wire_dtype = "fp32"  # 4 bytes a parameter: a swap of ~460 kB each way
    m.train.min_step_seconds = 1.0  # rounds of ~4 s: the 4 rounds a swap may take hold it
    harness = harness_factory(m, harness_class=FaultHarness)
    with netns_link.NamespaceLink() as link:
        link.shape(LINK)
        first = harness.start_node(0, extra=["--min-peers", "1", "--listen", link.host_listen])
        first.wait_for(has("joined"), 90, "joining")
        reachable = next(a for a in (first.data_dir / "address").read_text().split()
                         if link.host_address in a)
        slow = harness.start_node(1, [reachable], ["--min-peers", "1"], netns=link.namespace,
                                  listen=link.inner_listen)
        events = slow.wait_for(has("swapped"), 240, "a swap over the slow link")
        swapped = next(e for e in events if e["event"] == "swapped")
        paired = [e for e in events if e["event"] == "paired" and e["round"] == swapped["round"]
                  and e["partner"] == swapped["partner"]]
        # the premise: this swap took longer than the old cut (its bytes over the link: ~7.5 s)
        assert paired and swapped["time"] - paired[-1]["time"] > PAIR_DEADLINE_S, (paired, swapped)
        assert swapped["bytes"] > 400_000
