"""Issue 8: SIGKILL at two more named points, mid-DiLoCoX send and mid late-join transfer
(tests/adversary.py --kind push-kill / serve-kill), and a node's link cut and restored
(tests/netns_link.py), on real daemons with real p2pd.

Asserted from the nodes' own records: the survivors keep training and agree, nothing half-sent
is ever used, and the node that lost its transfer recovers (restarts from its data directory,
or takes the state from another member).
"""

import signal
import time

import pytest

from tests import netns_link
from tests.faults import (FaultHarness, adversary_manifest, has, stop_all, timeline,
                          two_nodes_and_a_killed_adversary, wait_exit)
from tests.swarm_harness import assert_phi_heals

# a veth pair on the host; 900 s: the first test may wait its turn on the host's network
# (tests/conftest.py) while another worker's Docker or NAT tests hold it
pytestmark = [pytest.mark.integration, pytest.mark.host_network, pytest.mark.timeout(900)]


def test_sigkill_mid_dilocox_send_survivors_agree_and_the_node_rejoins(harness_factory):
    harness = harness_factory(adversary_manifest("t-push-kill", "dilocox"), harness_class=FaultHarness)
    survivors, victim, killed_at = two_nodes_and_a_killed_adversary(
        harness, "push-kill", "SIGKILL mid-DiLoCoX send")
    first, victim_id = survivors[0], victim.peer_id
    for node in survivors:  # no exchange waits on the dead node past its deadline
        node.wait_for(lambda ev: sum(e["event"] == "round" and e["time"] > killed_at
                                     for e in ev) >= 3, 120, "three rounds after the kill")
    # the killed node comes back from its data directory as a plain node
    back = harness.start_node(2, [first.address], data_dir=victim.data_dir)
    def returns(events: list[dict]) -> list[dict]:
        return [e for e in events if e["event"] in ("resumed", "late_join") and e["time"] > killed_at]
    back_at = returns(back.wait_for(returns, 90, "the restarted node to resume or join late"))[0]["time"]

    def holds_the_survivors_phi(events: list[dict]) -> bool:
        """A round after it came back in which its φ equals both survivors'. Resuming from its
        checkpoint it missed messages, so its first φ may differ and the consensus check
        resync it (then only a round after that counts: the round it resynced in may still
        split it again); taking a member's state it may agree at once, with no resync (a suite
        run waited 90 s for a resync that was never needed)."""
        resyncs = [e["round"] for e in events
                   if e["event"] in ("resync_ready", "replay_ready") and e["time"] > back_at]
        theirs = [{r["round"]: r["phi_digest"] for r in n.events("round")} for n in survivors]
        return any(e["event"] == "round" and e["time"] > back_at and e["round"] > max(resyncs, default=-1)
                   and all(d.get(e["round"]) == e["phi_digest"] for d in theirs) for e in events)
    back.wait_for(holds_the_survivors_phi, 90, "the restarted node to hold the survivors' φ")
    assert stop_all([*survivors, back]) == [0, 0, 0]
    common = assert_phi_heals(survivors)  # a message only one survivor got splits them; it heals
    # its half-sent message was never applied by anyone
    applied = [r for n in survivors for r in n.events("round")
               if r["time"] > killed_at and victim_id in (r.get("group") or [])]
    assert all(r["applied_round"] != 0 for r in applied), applied
    longest = max(r["round_seconds"] + r["outer_seconds"] for n in survivors
                  for r in n.events("round") if r["time"] > killed_at)
    print(f"push-kill: survivors' φ checked over rounds {common}, longest round after the kill "
          f"{longest:.1f} s; restarted node: {[e['event'] for e in back.events()][:6]}")
    assert longest < 30


def test_sigkill_mid_late_join_transfer_the_joiner_takes_another_members_state(harness_factory):
    """The serving member dies halfway through the first state reply it sends the joiner (a
    sketch of its state, or a range of it, whichever the joiner asks it first); the joiner goes
    on with the other members and starts from a verified state of theirs. (A download broken
    mid-range and resumed at another holder: tests/integration/test_state_transfer.py.)"""
    harness = harness_factory(adversary_manifest("t-serve-kill"), harness_class=FaultHarness)
    paced = ["--min-peers", "2", "--set", "train.min_step_seconds=0.25"]
    first = harness.start_node(0, extra=paced)
    first.wait_for(has("joined"), 90, "joining")
    second = harness.start_node(1, [first.address], paced)
    # the joiner asks every member (node/daemon/state_quorum.py); paced too, because a member
    # more than 4x + 16 rounds ahead of the majority is banned as a liar and never asked
    server = harness.start_adversary(2, "serve-kill", [first.address],
                                     ["--min-peers", "2", "--set", "train.min_step_seconds=0.1"])
    server_id = server.peer_id
    for node in (first, second):
        node.wait_rounds(2, timeout=90)
    server.wait_for(lambda ev: sum(e["event"] == "round" for e in ev) >= 5, 60,
                    "the serving member to train")
    joiner = harness.start_node(3, [first.address])
    assert wait_exit(server, 120) == -signal.SIGKILL, server.log_tail()
    assert "SIGKILL mid late-join transfer" in server.log_tail(100_000)
    late = joiner.wait_for(has("late_join"), 120, "the joiner to start from a member's state")
    source = next(e for e in late if e["event"] == "late_join")["source"]
    assert source in (first.peer_id, second.peer_id), source
    assert server_id not in next(e for e in late if e["event"] == "late_join").get("sources", ())
    joiner.wait_rounds(2, timeout=90)
    for node in (first, second):
        node.wait_rounds(len(node.events("round")) + 1, timeout=60)
    assert stop_all([first, second, joiner]) == [0, 0, 0]


@pytest.mark.skipif(netns_link.available() is not None, reason=str(netns_link.available()))
def test_a_cut_link_fails_swaps_fast_and_the_node_pairs_again_once_restored(harness_factory):
    """One node sits in its own network namespace; its link goes down for 30 s, then up."""
    m = adversary_manifest("t-link-cut")
    harness = harness_factory(m, harness_class=FaultHarness)
    with netns_link.NamespaceLink() as link:
        extra = ["--min-peers", "2", "--listen", link.host_listen]
        first = harness.start_node(0, extra=extra)
        first.wait_for(has("joined"), 90, "joining")
        reachable = next(a for a in (first.data_dir / "address").read_text().split()
                         if link.host_address in a)
        second = harness.start_node(1, [reachable], extra)
        cut_off = harness.start_node(2, [reachable], ["--min-peers", "2"], netns=link.namespace,
                                     listen=link.inner_listen)
        others = [first, second]
        cut_off.wait_for(lambda ev: any(e["event"] == "round" and e.get("partner") for e in ev),
                         120, "the namespaced node to pair before the cut")
        link.cut()
        cut_at = time.time()
        for node in [*others, cut_off]:  # everyone keeps training through the cut
            node.wait_for(lambda ev: sum(e["event"] == "round" and e["time"] > cut_at + 20
                                         for e in ev) >= 2, 120, "two rounds well into the cut")
        # the others pair with each other once their proposals to the cut node have timed out
        # (10 s each) or it has left their view; on a loaded machine that can be later than the
        # cut node's second round past cut + 20 s, so it is waited for, not assumed
        try:
            first.wait_for(lambda ev: any(e["event"] == "round" and e.get("partner")
                                          and e["time"] > cut_at + 20 for e in ev), 90,
                           "the others to pair with each other well into the cut")
        except AssertionError as failure:
            raise AssertionError(f"{failure}\ncut at {cut_at:.0f}; "
                                 f"{timeline([*others, cut_off], cut_at - 5)}") from None
        link.restore()
        restored_at = time.time()
        try:
            cut_off.wait_for(lambda ev: any(e["event"] == "round" and e.get("partner")
                                            and e["time"] > restored_at for e in ev), 150,
                             "the namespaced node to pair again after the restore")
        except AssertionError as failure:
            raise AssertionError(f"{failure}\ncut at {cut_at:.0f}, restored at {restored_at:.0f}; "
                                 f"{timeline([*others, cut_off], cut_at - 5)}") from None
        assert stop_all([*others, cut_off]) == [0, 0, 0]
    cut_id = cut_off.peer_id
    during = lambda n: [r for r in n.events("round") if cut_at + 20 < r["time"] < restored_at]  # noqa: E731
    assert not [r for r in during(cut_off) if r.get("partner")], "paired across a cut link"
    assert any(r.get("partner") for n in others for r in during(n)), "the others stopped pairing"
    # no exchange hung: rounds in the cut are no longer than a deadline-bounded swap allows
    longest = max(r["round_seconds"] + r["outer_seconds"] for n in [*others, cut_off]
                  for r in n.events("round") if cut_at < r["time"] < restored_at)
    failed = [e for n in others for e in n.events() if e["event"] in ("swap_failed", "swap_late")
              and e.get("partner") == cut_id and e["time"] > cut_at]
    print(f"link cut: longest round in the cut {longest:.1f} s; swaps with the cut node that "
          f"failed {len(failed)}; rounds of the cut node in the cut {len(during(cut_off))}\n"
          f"{timeline([*others, cut_off], cut_at - 5)}")
    assert longest < 30
