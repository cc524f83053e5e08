"""A DiLoCoX node that falls rounds behind its swarm (its process stopped, as a laptop that
sleeps) takes the swarm's state and round mid-run and trains with it again, on real daemons.

Without the catch-up (node/rounds/dilocox/exchange.py `catch_up`) it never would: every member
refuses its messages as stale and the consensus check finds no vote for the rounds it compares.
"""

import signal
import time

import pytest

from tests.faults import has, stop_all
from tests.swarm_harness import small_manifest

pytestmark = pytest.mark.integration


# beside: the catch-up arrives in a round's end that runs beside training (join --round-end)
@pytest.mark.parametrize("round_end", ["inline", "beside"])
def test_a_dilocox_node_stopped_for_rounds_catches_up_and_holds_the_swarms_phi(harness_factory,
                                                                               round_end):
    harness = harness_factory(small_manifest(f"t-catch-up-{round_end}", "dilocox"))
    nodes = harness.start(3, extra=["--round-end", round_end])
    for node in nodes:
        node.wait_rounds(2, timeout=120)
    sleeper, others = nodes[2], nodes[:2]
    sleeper.process.send_signal(signal.SIGSTOP)
    try:
        stopped_at = time.time()
        asleep_round = max(r["round"] for r in sleeper.events("round"))
        for node in others:  # the swarm moves on without it
            node.wait_for(lambda ev: sum(e["event"] == "round" and e["time"] > stopped_at
                                         for e in ev) >= 5, 120, "five rounds while one sleeps")
    finally:
        sleeper.process.send_signal(signal.SIGCONT)
    caught = sleeper.wait_for(has("caught_up"), 120, "the node that slept to catch up")
    event = next(e for e in caught if e["event"] == "caught_up")
    # awake, it ends the round it was in, asks for the state at a round's end and takes it at
    # a later one (the download runs in the background, while its own rounds go on: how many
    # depends on the machine's load, 1 here, 4 in CI): it jumps to the swarm's round, past the
    # rounds it slept through, instead of training through them
    assert event["round"] >= asleep_round + 5 and event["round"] - event["from_round"] >= 2, event

    def holds_the_swarms_phi(events: list[dict]) -> bool:
        theirs = [{r["round"]: r["phi_digest"] for r in n.events("round")} for n in others]
        return any(e["event"] == "round" and e["round"] > event["round"]
                   and all(d.get(e["round"]) == e["phi_digest"] for d in theirs) for e in events)
    sleeper.wait_for(holds_the_swarms_phi, 90, "the node that slept to hold the swarm's φ")
    assert stop_all(nodes) == [0, 0, 0]
    # from then on the others take its messages again: a round that applied one of them
    rounds_after = [r for n in others for r in n.events("round") if r["round"] > event["round"]]
    assert any(sleeper.peer_id in (r.get("group") or []) for r in rounds_after), rounds_after[-3:]
