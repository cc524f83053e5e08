"""Issue 8: faults injected into real daemons at named points (loopback, real p2pd).

- a SIGKILL inside a checkpoint write (tests/adversary.py --kind ckpt-kill): the previous
  checkpoint stays loadable and the node resumes from it;
- a full disk (a small tmpfs as the data directory): one sentence, a clean exit, and no
  half-written checkpoint;
- the node's own p2pd killed under it: the daemon stops with one sentence, checkpointing first;
  its partner carries on.
"""

import signal
import time

import pytest

from node.train.checkpoint import CheckpointStore
from tests.faults import (
    FaultHarness,
    adversary_manifest,
    can_mount,
    finished,
    has,
    tmpfs,
    two_nodes_and_a_killed_adversary,
    wait_exit,
)

pytestmark = pytest.mark.integration


def alone(manifest):
    """A node of one: rounds end with local updates, a checkpoint after every round."""
    manifest.train.checkpoint_every = manifest.protocol.inner_steps
    return manifest


def test_sigkill_inside_a_checkpoint_write_leaves_the_previous_one_loadable(harness_factory):
    harness = harness_factory(alone(adversary_manifest("t-ckpt-kill")), harness_class=FaultHarness)
    node = harness.start_node(0, adversary="ckpt-kill",
                              env={"LOWCOMM_TEST_KILL_AT_CHECKPOINT": "3"})
    assert wait_exit(node, 180) == -signal.SIGKILL, node.log_tail()
    assert "SIGKILL inside checkpoint write 3" in node.log_tail(100_000)
    directory = node.data_dir / "checkpoints"
    torn = list(directory.glob(".ckpt-*.tmp-*"))
    assert len(torn) == 1 and torn[0].stat().st_size > 0  # the half-written file is there
    store = CheckpointStore(directory)
    assert [p.name for p in store.paths()] == ["ckpt-0000000040.pt", "ckpt-0000000020.pt"]
    loaded = store.load_latest()
    assert loaded.skipped == [] and loaded.state["trainer"]["step"] == 40
    # the same data directory, the real daemon: resumes from step 40, drops the torn file
    again = harness.start_node(0, extra=["--max-steps", "20"], data_dir=node.data_dir)
    again.wait_for(finished, 120, "resuming and a clean exit")
    assert wait_exit(again, 30) == 0
    resumed = again.events("resumed")[-1]
    assert resumed["checkpoint"] == "ckpt-0000000040.pt" and resumed["step"] == 40
    assert not list(directory.glob(".ckpt-*.tmp-*"))


@pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root")
def test_a_full_disk_stops_the_node_cleanly_with_no_half_written_checkpoint(harness_factory,
                                                                              tmp_path):
    # a checkpoint of this model is 2.3 MB: the first fits in 3.5 MB, the second does not
    with tmpfs(tmp_path / "small-disk", "3500k") as data_dir:
        harness = harness_factory(alone(adversary_manifest("t-full")), "full", harness_class=FaultHarness)
        node = harness.start_node(0, data_dir=data_dir)
        try:
            code = wait_exit(node, 180)
        finally:
            harness.close()  # nothing may hold the tmpfs when it is unmounted
        events = node.events()
        failed = [e for e in events if e["event"] == "failed"]
        checkpoints = [p.name for p in (data_dir / "checkpoints").iterdir()]
        print("exit", code, "failed:", failed, "files:", checkpoints)
        assert code == 1, node.log_tail()
        assert len(failed) == 1, node.log_tail()
        assert "could not write checkpoint ckpt-0000000040.pt" in failed[0]["error"]
        assert "No space left on device; the previous checkpoint is kept" in failed[0]["error"]
        assert finished(events)  # it still left the swarm cleanly
        assert checkpoints == ["ckpt-0000000020.pt"], checkpoints  # no temporary left behind
        assert CheckpointStore(data_dir / "checkpoints").load_latest().state["trainer"]["step"] == 20


def test_killing_the_nodes_p2pd_stops_it_with_one_sentence(harness_factory):
    """Without its p2pd a node can reach nobody and nobody can reach it: it says so in one
    sentence, checkpoints and exits 1 (it used to train on alone, silently, for ever); its
    partner carries on; restarted, it rejoins from that checkpoint."""
    harness = harness_factory(adversary_manifest("t-p2pd"), harness_class=FaultHarness)
    a, b = harness.start(2)
    a.wait_for(has("swapped"), 120, "a first swap")
    started = time.monotonic()
    harness.kill_p2pd(b)
    assert wait_exit(b, 60) == 1, b.log_tail()
    took = time.monotonic() - started
    events = b.events()
    failed = [e for e in events if e["event"] == "failed"]
    assert len(failed) == 1 and "p2pd" in failed[0]["error"], failed
    assert "killed by signal 9" in failed[0]["error"]
    kinds = [e["event"] for e in events]
    after = kinds[kinds.index("failed"):]
    assert "checkpoint" in after and after[-1] == "left", after
    print(f"p2pd killed: node exited 1 after {took:.1f} s: {failed[0]['error']}")
    rounds = len(a.events("round"))
    a.wait_rounds(rounds + 1, timeout=90)  # the partner carries on alone
    again = harness.start_node(1, [a.address], data_dir=b.data_dir)
    again.wait_for(has("resumed"), 90, "resuming from the checkpoint")


def test_sigkill_mid_swap_partner_does_a_local_update_and_nobody_hangs(harness_factory):
    """The third node SIGKILLs itself halfway through the first frame of its first snapshot
    (tests/adversary.py --kind swap-kill). Its partner's swap fails at once, that round ends
    with a local update, and the two survivors go on pairing with each other."""
    harness = harness_factory(adversary_manifest("t-swap-kill"), harness_class=FaultHarness)
    survivors, victim, killed_at = two_nodes_and_a_killed_adversary(
        harness, "swap-kill", "SIGKILL mid-swap")
    (first, second), victim_id = survivors, victim.peer_id
    first.wait_for(lambda ev: any(e["event"] == "swapped" and e["partner"] == second.peer_id
                                  and e["time"] > killed_at for e in ev), 120,
                   "the survivors pairing with each other")
    # the partner of the killed swap: the survivor that paired with the victim last
    partner = max(survivors, key=lambda n: max([e["time"] for e in n.events("paired")
                                                 if e["partner"] == victim_id], default=0))
    partner.wait_rounds(len(partner.events("round")) + 1, timeout=60)
    events = partner.events()
    failed = [e for e in events if e["event"] in ("swap_failed", "swap_late")
              and e["partner"] == victim_id]
    used = [e for e in events if e["event"] == "round" and e.get("partner") == victim_id]
    assert not used, "a half-sent snapshot must never be used"
    # nobody waited on the dead node: rounds right after the kill are as long as before it
    rounds = [e for e in events if e["event"] == "round"]
    longest = max(e["round_seconds"] + e["outer_seconds"] for e in rounds if e["time"] > killed_at)
    print(f"mid-swap kill: partner events {[(e['event'], e.get('error', '')[:80]) for e in failed]}, "
          f"longest round after the kill {longest:.1f} s")
    assert longest < 30
    if victim_id < partner.peer_id:  # the victim initiated: its half-sent request is dropped
        assert not failed or "refused our" in failed[-1]["error"], failed
    else:  # the victim was replying: the partner's swap fails at once, as a stream that ended
        # short (TRUNCATED) or broke (a reset), depending on how the kill reached the socket
        error = failed[-1]["error"]
        assert "TRUNCATED" in error or "broke during the swap" in error, failed
