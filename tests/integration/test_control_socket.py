"""The control socket as an operator uses it: a server in a running loop, and
`lowcomm-node status` in another process."""

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from node.ops.control import ControlServer, ControlSocketError, control_socket_path, query_status
from node.ops.status import NodeStatus

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-m", "node.cli"]


@pytest.fixture
def data_dir():
    # Short on purpose: a unix socket path must stay under ~104 bytes.
    with tempfile.TemporaryDirectory(prefix="lc-ctl-") as d:
        yield Path(d) / "node"


def sample_status() -> NodeStatus:
    s = NodeStatus(peer_id="12D3KooWControlSocketTestPeer", swarm="ctl-swarm",
                   protocol="noloco", state="training", round=7, step=1234,
                   tokens_per_second=5678.5, peers_known=4, peers_alive=3,
                   bytes_sent_round=1000, bytes_received_round=2000, compression_ratio=4.0,
                   refused={"bad_signature": 2}, partners=["12D3KooWPartner"],
                   last_exchange_at=time.time() - 5)
    s.record_train_loss(3.25)
    s.record_val_loss(3.5)
    return s


async def run_cli(*args: str) -> subprocess.CompletedProcess:
    proc = await asyncio.create_subprocess_exec(*CLI, *args, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


def test_status_json_from_another_process_matches(data_dir):
    status = sample_status()

    async def main():
        async with ControlServer(data_dir, status.to_dict) as server:
            mode = stat.S_IMODE(os.stat(server.path).st_mode)
            assert stat.S_ISSOCK(os.stat(server.path).st_mode) and mode == 0o600, oct(mode)
            result = await run_cli("status", "--json", "--data-dir", str(data_dir))
            # the view too, printed once (stdout is not a terminal)
            view = await run_cli("status", "--data-dir", str(data_dir))
        assert not server.path.exists(), "stop() removes the socket"
        return result, view

    result, view = asyncio.run(main())
    assert result.returncode == 0, result.stderr
    got, want = json.loads(result.stdout), status.to_dict()
    for key in ("peer_id", "swarm", "protocol", "state", "round", "step", "tokens_per_second",
                "train_loss", "val_loss", "peers_known", "peers_alive", "bytes_sent_round",
                "bytes_received_round", "compression_ratio", "refused", "partners",
                "last_exchange_at", "schema"):
        assert got[key] == want[key], key
    assert view.returncode == 0, view.stderr
    assert "ctl-swarm" in view.stdout and "5,678" in view.stdout and "bad_signature" in view.stdout


def test_no_daemon_is_one_sentence_and_exit_1(data_dir):
    data_dir.mkdir(parents=True)
    for setup in ("nothing", "stale"):
        if setup == "stale":  # a socket file left by a daemon that was SIGKILLed
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(control_socket_path(data_dir)))
            s.close()
        result = subprocess.run([*CLI, "status", "--data-dir", str(data_dir)],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 1 and result.stdout == ""
        message = result.stderr.strip()
        assert message.startswith("lowcomm-node: error: no lowcomm-node daemon is running")
        assert "\n" not in message and message.count(". ") == 0 and message.endswith(".")


def test_stale_socket_is_replaced_and_a_live_one_is_not(data_dir):
    data_dir.mkdir(parents=True)
    path = control_socket_path(data_dir)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    status = sample_status()

    async def main():
        async with ControlServer(data_dir, status.to_dict):
            assert (await asyncio.to_thread(query_status, data_dir))["round"] == 7
            with pytest.raises(ControlSocketError, match="already running"):
                await ControlServer(data_dir, status.to_dict).start()
            assert (await asyncio.to_thread(query_status, data_dir))["round"] == 7

    asyncio.run(main())
    assert not path.exists()


def test_a_silent_client_does_not_block_others(data_dir):
    status = sample_status()

    async def main():
        async with ControlServer(data_dir, status.to_dict) as server:
            reader, writer = await asyncio.open_unix_connection(str(server.path))
            writer.write(b"stat")  # no newline: a stuck client holds only its own connection
            status.update(round=8)
            got = await asyncio.wait_for(asyncio.to_thread(query_status, data_dir), 5)
            writer.close()
            return got

    assert asyncio.run(main())["round"] == 8


def test_too_long_path_is_refused_clearly():
    async def main():
        await ControlServer("/tmp/" + "d" * 120, dict).start()

    with pytest.raises(ControlSocketError, match="shorter data directory"):
        asyncio.run(main())


def test_status_finds_the_daemon_under_runs_or_by_swarm(data_dir):
    """Without --data-dir: --swarm ID means join's default runs/<ID>; with neither, the one
    daemon running under runs/."""
    cwd = data_dir.parent
    status = sample_status()

    async def main():
        async with ControlServer(cwd / "runs" / "ctl-swarm", status.to_dict):
            results = []
            for args in (["--swarm", "ctl-swarm"], []):
                proc = await asyncio.create_subprocess_exec(
                    *CLI, "status", "--json", *args, cwd=cwd, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)
                out, err = await asyncio.wait_for(proc.communicate(), 30)
                results.append((proc.returncode, out, err))
            return results

    for rc, out, err in asyncio.run(main()):
        assert rc == 0, err
        assert json.loads(out)["step"] == 1234
