"""Issue 24: a lying state server among real daemons (NoLoCo, loopback, real p2pd).

Two honest members and one liar run through tests/adversary.py (state-poison: it serves φ x 1000
under the digest it announced itself; state-round: its record, announcements and served state
claim rounds 10^6 ahead). A fresh node then joins late. Asserted from what the joiner writes: it
started from an honest member's state, at a round the honest members reached, banned the liar
with a sentence naming it, and trains on. tests/integration/test_state_quorum.py covers every
lie case on real hosts without daemons.
"""

import pytest

from tests.faults import FaultHarness, has, joined, stop_all
from tests.swarm_harness import small_manifest

pytestmark = pytest.mark.integration
BANNED_FOR = {"state-poison": "more than 10x this node's own", "state-round": "claims round"}


@pytest.mark.parametrize("kind", ["state-poison", "state-round"])
def test_a_lying_state_server_is_banned_and_the_joiner_starts_from_an_honest_state(harness_factory, kind):
    harness = harness_factory(small_manifest(f"t-liar-{kind}", "noloco"), harness_class=FaultHarness)
    extra = ["--min-peers", "2"]
    first = harness.start_node(0, extra=extra)
    first.wait_for(joined, 90, "joining")
    second = harness.start_node(1, [first.address], extra)
    liar = harness.start_adversary(2, kind, [first.address], extra)
    honest = [first, second]
    for node in honest:
        node.wait_rounds(3, timeout=120)
    joiner = harness.start_node(3, [first.address])
    events = joiner.wait_for(has("late_join"), 120, "the joiner to start from a member's state")
    late = next(e for e in events if e["event"] == "late_join")
    log = joiner.log_tail(100_000)
    assert late["source"] in (first.peer_id, second.peer_id), (late, log[-3000:])
    assert any(liar.peer_id in line and BANNED_FOR[kind] in line and "banned for" in line
               for line in log.splitlines()), log[-3000:]
    reached = max(len(node.events("round")) for node in honest) + 2
    assert 1 <= late["round"] <= reached, (late, reached)
    joiner.wait_rounds(2, timeout=90)
    assert all(r.get("partner") != liar.peer_id for r in joiner.events("round"))
    assert stop_all([first, second, liar, joiner]) == [0, 0, 0, 0]
