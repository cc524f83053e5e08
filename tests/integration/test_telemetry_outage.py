"""A broker that dies mid-run changes nothing in training: the same seeded `join` run (same
identity, hence the same batch stream; one torch thread; no peers), twice, side by side, each
publishing to its own real mosquitto. One broker stays up, the other is SIGKILLed as soon as
the node's first training status has arrived and never comes back. The per-step training
losses (and the validation losses) must be bitwise equal, the node must say once that the
broker is gone, and it must train on to the end of its run with the broker dead.

Why training cannot wait on the broker, by construction: the training thread never calls the
publisher; it hands each event to the event loop without waiting (LoopBridge.post) and waits on
the loop only for the protocol's network (LoopBridge.call: a round's end, a partner's snapshot
landed; a node alone, as here, at its rounds' ends); and the loop never blocks on MQTT: every
connection is opened in a thread of its own and every read and write the loop makes goes to a
non-blocking socket (tests/integration/test_telemetry.py, MqttThreads, against a dead broker and
one that never answers). This test does not time steps: on a shared machine a step's wall-clock
time measures the load, not the telemetry.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from node.ops.telemetry import status_topic
from p2p.identity import NodeIdentity, identity_path
from tests.mqtt_broker import retained
from tests.mqtt_broker import MosquittoBroker, require_mosquitto
from tests.swarm_harness import SwarmHarness, left, small_manifest

pytestmark = pytest.mark.integration
STEPS = 120


def test_killing_the_broker_mid_run_leaves_the_loss_curve_unchanged(tmp_path):
    require_mosquitto()
    m = small_manifest("outage", "noloco")
    m.train.eval_every = 20
    brokers, harnesses, nodes = [], [], []
    key = identity_path(tmp_path / "identity")
    NodeIdentity.load_or_create(key)
    try:
        for name in ("up", "killed"):
            (tmp_path / f"broker-{name}").mkdir()
            brokers.append(MosquittoBroker(tmp_path / f"broker-{name}"))
            brokers[-1].start()
            harnesses.append(SwarmHarness(tmp_path / name, m))
            data_dir = tmp_path / name / "node"
            identity = identity_path(data_dir)
            identity.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(key, identity)  # the same seed: the batch stream follows the key
            nodes.append(harnesses[-1].start_node(0, data_dir=data_dir, extra=[
                "--mqtt", brokers[-1].url, "--mqtt-interval", "0.2",
                "--max-steps", str(STEPS)]))
        up, killed = nodes
        killed.wait_for(lambda ev: any(e["event"] == "joined" for e in ev), 90, "joining")
        _, doc = asyncio.run(retained(brokers[1].url, status_topic("outage", killed.peer_id),
                                      lambda d: d.get("online") and d.get("step", 0) >= 10, 60))
        brokers[1].kill()
        killed_at = time.time()
        for node in nodes:
            node.wait_for(left, 120, "the end of training")
            assert node.process.wait(timeout=30) == 0, node.log_tail()
    finally:
        for harness in harnesses:
            harness.close()
        for broker in brokers:
            broker.stop()

    curves = [[e["loss"] for e in node.events("step")] for node in nodes]
    vals = [[e["val_loss"] for e in node.events("round") if "val_loss" in e] for node in nodes]
    assert up.peer_id == killed.peer_id
    assert len(curves[0]) == STEPS and len(vals[0]) == STEPS // 20
    assert curves[0] == curves[1], "the broker outage changed the training losses"
    assert vals[0] == vals[1]
    for node in nodes:  # alone: no partner ever changed the weights
        assert all(not r["partner"] for r in node.events("round"))

    killed_steps = [e for e in killed.events("step") if e["time"] > killed_at]
    log = killed.log_tail(100_000)
    unreachable = [line for line in log.splitlines() if "MQTT telemetry: broker" in line
                   and "unreachable" in line]
    print(f"broker killed at step {doc['step']}; {len(killed_steps)} steps after the kill; "
          f"first/last loss {curves[1][0]!r} / {curves[1][-1]!r}; identical over {STEPS} "
          f"steps; log: {unreachable}")
    assert len(unreachable) == 1, log
    assert "is back" not in log and "unreachable" not in up.log_tail(100_000)
    assert len(killed_steps) >= STEPS // 2  # most of the run trained with the broker dead
    assert killed_steps[-1]["step"] == STEPS  # and it trained to the end of its run
