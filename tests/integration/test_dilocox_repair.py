"""A DiLoCoX split forced on real daemons, and its repair (node/rounds/dilocox/consensus.py,
replay.py, round.py `_repaired`): three `lowcomm-node join` processes on loopback, one of them
under the `split` fault of tests/adversary.py: its outer step of round SPLIT_ROUND leaves out
one member's message that the other two apply. Its φ of the round after must leave theirs (the
test fails if no split happened), its consensus check must find it off the majority's and
bring a repair (a replay of its steps over the majority's messages, or a download), and from
then on all three must end every round on one φ. A run without the fault needs no repair, so
a run that passes here has exercised the repair path.
"""

import pytest

from tests.adversary import SPLIT_ROUND
from tests.faults import FaultHarness, adversary_manifest, start_swarm, stop_all
from tests.swarm_harness import left, phi_rounds

pytestmark = pytest.mark.integration
STEPS = 160  # 8 rounds of 20 inner steps
SPLIT = SPLIT_ROUND + 1  # delay 1: round r's messages are applied at the end of round r + 1


@pytest.mark.timeout(600)
def test_a_message_one_node_left_out_splits_phi_and_the_repair_brings_it_back(harness_factory):
    harness = harness_factory(adversary_manifest("t-dx-split", "dilocox"), harness_class=FaultHarness)
    honest, faulty = start_swarm(harness, 2, "split", extra=["--max-steps", str(STEPS)])
    nodes = [*honest, faulty]
    try:
        for node in nodes:
            node.wait_for(left, 300, "the node to finish and leave")
    finally:
        stop_all(nodes)
    assert f"adversary: round {SPLIT_ROUND}: the message of" in faulty.log_tail(1_000_000)
    common, split, digests = phi_rounds(nodes)
    print(f"rounds all nodes ended: {common}; split: {split}")
    # the fault took effect: the faulty node's φ left the others' at the round that applied it
    assert SPLIT in split, (split, digests)
    assert len({digests[0][SPLIT], digests[1][SPLIT]}) == 1  # the two others agree
    # its check found it off the majority, and a repair came for it
    diverged = [e for e in faulty.events("diverged") if e["round"] >= SPLIT]
    assert diverged, faulty.events("diverged")
    repairs = [e for e in faulty.events("replay_ready") + faulty.events("resync_ready")
               if e["time"] >= diverged[0]["time"]]
    assert repairs, "no repair followed the divergence"
    # and it was taken: one φ on every node two rounds after the split, and ever after
    after = [r for r in common if r >= SPLIT + 2]
    assert len(after) >= 2, common
    assert not [r for r in split if r in after], f"φ still split after the repair: {split} {digests}"
