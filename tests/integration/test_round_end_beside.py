"""`join --round-end beside` on real daemons: DiLoCoX's round end (message, outer step, digest) in
a thread beside training, on three nodes; separate processes, real p2pd, loopback only."""

import subprocess
import sys

import pytest

from tests.swarm_harness import assert_one_phi, left, small_manifest

pytestmark = pytest.mark.integration


def test_three_nodes_ending_rounds_beside_training_agree_on_phi_and_apply_every_group(
        harness_factory):
    m = small_manifest("t-beside", "dilocox", apply_on_arrival=True)
    m.train.eval_every = 40
    harness = harness_factory(m)
    nodes = harness.start(3, extra=["--max-steps", "160", "--round-end", "beside"])
    for node in nodes:
        node.wait_for(left, 400, "the node to finish and leave")
    common = assert_one_phi(nodes)
    for node in nodes:
        rounds = node.events("round")
        assert [r["round"] for r in rounds] == list(range(len(rounds))), "a round reported twice"
        assert sum(len(r["group"]) == 3 for r in rounds) >= len(rounds) // 2, \
            [r["group"] for r in rounds]
        # the trainer was held only to copy θ and to apply the round's end, not for the network
        assert max(r["outer_seconds"] for r in rounds) < 2.0, [r["outer_seconds"] for r in rounds]
        vals = [r["val_loss"] for r in rounds if "val_loss" in r]
        assert vals[-1] < vals[0], vals
    print(f"rounds all three ended: {len(common)}")


def test_round_end_beside_is_refused_for_noloco_with_one_sentence(tmp_path):
    done = subprocess.run([sys.executable, "-m", "node.cli", "join", "--swarm", "local",
                           "--data-dir", str(tmp_path), "--round-end", "beside"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2  # a usage error, refused before anything starts
    assert done.stderr.strip() == ("lowcomm-node: config error: --round-end beside is for DiLoCoX "
                                   "swarms, and local runs noloco: leave it out (NoLoCo's round "
                                   "end runs on the training device)")
