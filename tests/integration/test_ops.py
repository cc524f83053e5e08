"""NodeOps, as the daemon plugs it in: control socket, telemetry, preemption and display
start together around the daemon's work and stop together, leaving nothing behind."""

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import pytest
from rich.console import Console

from node.ops.control import control_socket_path, query_status
from node.ops.monitor import collect_swarm
from node.ops.services import NodeOps
from node.ops.cli import add_join_ops_arguments
from node.ops.status import NodeStatus
from tests.fake_metadata import FakeMetadataServer

pytestmark = pytest.mark.integration


def test_node_ops_runs_every_service_and_cleans_up(mosquitto_broker):
    fake = FakeMetadataServer("gcp")
    parser = argparse.ArgumentParser()
    add_join_ops_arguments(parser)
    args = parser.parse_args(["--mqtt", mosquitto_broker.url, "--mqtt-interval", "0.1",
                              "--preemption", "gcp", "--metadata-url", fake.url,
                              "--preemption-interval", "0.1"])
    status = NodeStatus(peer_id="12D3KooWops", swarm="ops", protocol="noloco")
    console = Console(record=True, width=100, force_terminal=False)

    async def main(data_dir: Path):
        stop = asyncio.Event()
        async with NodeOps.from_args(status, data_dir, args, on_preemption=lambda r: stop.set(),
                                     console=console, sample_every=0.05) as ops:
            status.update(state="training", round=2)
            await asyncio.wait_for(ops.telemetry.first_publish.wait(), 10)
            doc = await asyncio.to_thread(query_status, data_dir)
            assert doc["round"] == 2 and doc["peer_id"] == "12D3KooWops"
            swarm = await collect_swarm(mosquitto_broker.url, "ops")
            assert [n["peer_id"] for n in swarm.docs()] == ["12D3KooWops"]
            fake.notice = True  # the cloud takes the instance back: the daemon's exit starts
            await asyncio.wait_for(stop.wait(), 10)
            assert status.to_dict()["rss_bytes"], "the usage sampler ran"
        assert not control_socket_path(data_dir).exists()
        swarm = await collect_swarm(mosquitto_broker.url, "ops")
        return swarm.docs()[0]

    try:
        with tempfile.TemporaryDirectory(prefix="lc-ops-") as d:
            last = asyncio.run(main(Path(d)))
    finally:
        fake.close()
    assert last["online"] is False, "telemetry said goodbye on stop"
    assert "round=2" in console.export_text(), "the plain display printed the status"


def test_join_options_read_the_environment(monkeypatch):
    monkeypatch.setenv("LOWCOMM_MQTT", "mqtts://u:p@broker:8883")
    monkeypatch.setenv("LOWCOMM_PREEMPTION", "aws")
    parser = argparse.ArgumentParser()
    add_join_ops_arguments(parser)
    args = parser.parse_args([])
    assert args.mqtt == "mqtts://u:p@broker:8883" and args.preemption == "aws"
    json.dumps(vars(args))


def test_on_a_terminal_logs_print_above_the_live_view_and_handlers_come_back():
    import logging
    import sys

    root = logging.getLogger()
    plain = logging.StreamHandler(sys.stderr)
    saved = list(root.handlers)
    root.handlers[:] = [plain]
    console = Console(record=True, width=100, force_terminal=True, color_system=None)
    status = NodeStatus(peer_id="12D3KooWtty", swarm="tty", protocol="noloco")

    async def main(data_dir: Path):
        async with NodeOps(status, data_dir, console=console):
            assert plain not in root.handlers and len(root.handlers) == 1
            logging.getLogger("lowcomm.test").warning("peer 12D3KooWx joined")
            await asyncio.sleep(0)
        assert root.handlers == [plain]

    try:
        with tempfile.TemporaryDirectory(prefix="lc-tty-") as d:
            asyncio.run(main(Path(d)))
    finally:
        root.handlers[:] = saved
    text = console.export_text()
    assert "peer 12D3KooWx joined" in text and "tty" in text
