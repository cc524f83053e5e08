"""Issue 7's network harness, the part that runs in CI: the delaying relay on loopback, and (as
root) a two-node ShapedSwarm whose namespaces are gone afterwards, even after a failure."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.netns import PREFIX, ShapedSwarm

pytestmark = pytest.mark.integration
RELAY = Path(__file__).resolve().parents[2] / "benchmarks" / "netns.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with server:
            connection, _ = server.accept()
            with connection:
                while data := connection.recv(1 << 16):
                    connection.sendall(data)
    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_the_relay_delays_each_direction_and_keeps_every_byte_in_order():
    _, target = _echo_server()
    listen = _free_port()
    relay = subprocess.Popen([sys.executable, str(RELAY), "relay", "--listen", f"127.0.0.1:{listen}",
                              "--target", f"127.0.0.1:{target}", "--delay-ms", "50",
                              "--max-buffer", str(64 << 10)], stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout.readline().startswith("relay")
        with socket.create_connection(("127.0.0.1", listen), timeout=10) as client:
            began = time.monotonic()
            client.sendall(b"x")
            assert client.recv(1) == b"x"
            round_trip = time.monotonic() - began
            # 2 MB through a 64 KiB buffer: flow control must hold, and nothing may be lost
            payload = os.urandom(2 << 20)
            sender = threading.Thread(target=client.sendall, args=(payload,))
            sender.start()
            received = bytearray()
            while len(received) < len(payload):
                received += client.recv(1 << 16)
            sender.join(timeout=10)
        assert 0.1 <= round_trip < 1.0, round_trip   # 50 ms each way, no more than scheduling
        assert bytes(received) == payload
    finally:
        relay.kill()
        relay.wait(timeout=10)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)}


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")
def test_a_shaped_swarm_limits_the_rate_adds_the_delay_and_leaves_nothing_behind():
    with ShapedSwarm(n=2, rate="8mbit", delay_ms=20) as swarm:
        server = swarm.popen(1, [sys.executable, "-c", (
            "import socket\n"
            "s = socket.create_server(('127.0.0.1', 4100)); c, _ = s.accept(); c.sendall(c.recv(1))\n"
            "n = 0\n"
            "while d := c.recv(1 << 16): n += len(d)\n"
            "c.sendall(str(n).encode())\n")])
        swarm.relay(1, 4101, ("127.0.0.1", 4100))
        sent_before = swarm.tx_bytes(0)
        client = swarm.popen(0, [sys.executable, "-c", (
            "import socket, time\n"
            f"c = socket.create_connection(('{swarm.address(1)}', 4101), timeout=30)\n"
            "t = time.monotonic(); c.sendall(b'x'); c.recv(1); rtt = time.monotonic() - t\n"
            "t = time.monotonic(); c.sendall(bytes(1 << 20)); c.shutdown(socket.SHUT_WR)\n"
            "n = int(c.recv(64)); print(rtt, n, time.monotonic() - t)\n")],
            stdout=subprocess.PIPE, text=True)
        output, _ = client.communicate(timeout=60)
        rtt, received, seconds = output.split()
        sent = swarm.tx_bytes(0) - sent_before
        server.wait(timeout=10)
        namespaces = set(swarm.namespaces) | {swarm.bridge_namespace}
        assert namespaces <= _namespaces()
    # only this run's own namespaces are checked: another run (a benchmark, a CI job in another
    # container) may hold namespaces with the same prefix at the same time
    assert int(received) == 1 << 20 and sent >= 1 << 20
    assert 0.04 <= float(rtt) < 0.5, rtt
    mbit = (1 << 20) * 8 / float(seconds) / 1e6
    assert 4.0 < mbit < 8.8, mbit                  # the link's 8 Mbit/s, not loopback's speed
    assert not namespaces & _namespaces()
    with pytest.raises(RuntimeError), ShapedSwarm(n=2, rate="8mbit") as failed:
        namespaces = set(failed.namespaces) | {failed.bridge_namespace}
        assert namespaces <= _namespaces()
        raise RuntimeError("a benchmark failing half-way")
    assert not namespaces & _namespaces()


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")
def test_a_process_tree_started_in_a_namespace_is_stopped_whole():
    """hivemind's trainer runs its DHT and averager in child processes, with p2pd under them:
    a capped time-to-loss run stopped the trainers alone and left 12 processes running through
    the runs after it. A child that ignores SIGTERM and outlives its parent goes too."""
    with ShapedSwarm(n=1, rate="8mbit") as swarm:
        parent = swarm.popen(0, [sys.executable, "-c", (
            "import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
        child = int(parent.stdout.readline())
        assert _running(child)
    assert parent.poll() is not None
    deadline = time.monotonic() + 10  # the kill is sent; its reaping is the init process's
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), f"process {child} outlived the swarm"
