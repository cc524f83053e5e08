"""DiLoCoX members that lie about their messages, as real daemons among honest ones (tests/
adversary.py kinds; separate processes, real p2pd, loopback, the `tiny`-sized test model).

- An equivocator signs two versions of each round's message and sends one to each half of the
  swarm (node/rounds/dilocox/evidence.py): the versions meet in the members' reports, every
  honest node bans it within two rounds, and every round whose outer step comes after the ban
  ends on one φ on every honest node: from the round after the one the ban landed in (with
  `apply_on_arrival`, the default, that round's step can be taken mid-round, before the proof
  came, on either version; its split is repaired at the next step).
- A member claiming rounds 10^9 ahead and pushing messages of those rounds
  (node/rounds/dilocox/bounds.py): its messages are refused unread with the reason, it is
  struck and banned, no honest round waits for it, and the relay store holds nothing of rounds
  beyond the bound.
"""

import re

import pytest

from node.rounds.dilocox.bounds import AHEAD_ROUNDS
from tests.faults import FaultHarness, adversary_manifest, start_swarm, stop_all
from tests.swarm_harness import assert_phi_heals, left, phi_rounds

pytestmark = pytest.mark.integration
STEPS = 160  # 8 rounds of 20 inner steps


def run(harness_factory, swarm: str, honest: int, kind: str):
    harness = harness_factory(adversary_manifest(swarm, "dilocox"), harness_class=FaultHarness)
    nodes, bad = start_swarm(harness, honest, kind, extra=["--max-steps", str(STEPS)])
    for node in nodes:
        node.wait_for(left, 600, "the node to finish and leave")
    stop_all([bad])
    return nodes, bad


def round_at(node, time: float) -> int:
    """The round `node` was training at `time` (the one after the last it ended)."""
    return max((r["round"] for r in node.events("round") if r["time"] < time), default=-1) + 1


@pytest.mark.timeout(600)  # five daemons beside the rest of the suite
def test_an_equivocator_is_banned_by_every_honest_node_and_phi_stays_one(harness_factory):
    honest, bad = run(harness_factory, "t-adv-dx-equivocate", 4, "equivocate")
    bad_id = bad.peer_id
    lied = [int(m) for m in re.findall(r"adversary: round (\d+): one version", bad.log_tail(1_000_000))]
    assert lied, bad.log_tail()
    banned_in = []
    for node in honest:
        proofs = [e for e in node.events("equivocated") if e["author"] == bad_id]
        assert proofs, f"node {node.index} never learned that {bad_id} equivocated"
        banned_in.append(round_at(node, proofs[0]["time"]))
    print(f"equivocated from round {min(lied)}; banned on the honest nodes in rounds {banned_in}")
    assert max(banned_in) <= min(lied) + 2, (lied[:3], banned_in)
    common, split, digests = phi_rounds(honest)
    after = [r for r in common if r > max(banned_in)]  # steps taken after every ban
    print(f"rounds all honest nodes ended: {common}; split: {split}")
    assert len(after) >= 5, common
    assert not [r for r in split if r in after], f"φ split after the ban: {split} {digests}"
    for node in honest:  # neither version reached an outer step after the ban
        for r in node.events("round"):
            if r["round"] >= max(banned_in) + 1:
                assert bad_id not in r["group"], (node.index, r)


def test_a_member_claiming_far_future_rounds_is_refused_and_waited_for_by_no_one(harness_factory):
    honest, bad = run(harness_factory, "t-adv-dx-future", 3, "future")
    bad_id = bad.peer_id
    assert "adversary: pushing a message of round" in bad.log_tail(1_000_000)
    for node in honest:
        log = node.log_tail(5_000_000)
        # its far messages are refused unread: with the reason, striking it until it is banned,
        # or BANNED where its records' claims had it banned before a push arrived (a loaded machine)
        assert f"banned {bad_id}" in log, node.index
        refused = node.events("transport")[-1]["refused_incoming"]
        assert (f"{bad_id} sent a message of round" in log and "beyond round" in log) \
            or refused.get("BANNED", 0) >= 1, node.index
        # no round waited for, or gave up on, its message
        waited = [e for e in node.events("missing") if bad_id in e["peers"]]
        assert not waited, (node.index, waited)
        # nothing of a round beyond the bound was ever stored
        stored = node.events("stored")
        assert len(stored) >= 5, node.index
        assert all(s["furthest_round"] <= s["round"] + AHEAD_ROUNDS + 2 for s in stored), stored
        assert refused.get("REFUSED", 0) + refused.get("BANNED", 0) >= 1
    common = assert_phi_heals(honest, min_rounds=5)
    print(f"far-future liar: honest φ checked over rounds {common}")
