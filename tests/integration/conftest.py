"""Fixtures for tests that start real p2pd processes: nothing they start may outlive them.

`p2p_cleanup` records every p2pd unix socket and every process a test starts; at teardown it
kills the processes that are still alive (by pid, never by name), waits for them with a bound,
removes the sockets, and fails the test if a socket it recorded was left behind by the code
under test (the hosts must clean up after themselves; this fixture is the safety net).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import pytest

from p2p.host import P2PHost, p2pd_socket_paths, remove_dead_sockets, socket_paths
from p2p.identity import NodeIdentity, identity_path

# The broker fixture of tests/mqtt_broker.py (the telemetry tests') is shared through this file.
try:
    from tests.mqtt_broker import mosquitto_broker  # noqa: F401
except ImportError:  # that module is not in every checkout yet
    pass


class P2PCleanup:
    def __init__(self):
        self.sockets: set[str] = set()
        self.processes: list[subprocess.Popen] = []
        self.pids: set[int] = set()
        self.killed_sockets: set[str] = set()

    def track_host(self, host: P2PHost) -> P2PHost:
        self.sockets.update(p2pd_socket_paths(host.p2p))
        return host

    def track_process(self, process: subprocess.Popen) -> subprocess.Popen:
        self.processes.append(process)
        return process

    def track_pid(self, pid: int, sockets: list[str]) -> None:
        self.pids.add(pid)
        self.sockets.update(sockets)

    def track_killed(self, sockets: list[str]) -> None:
        """Sockets a process listened on before the test SIGKILLed it: no code can remove them
        after that, so this fixture removes them without blaming the code under test."""
        self.killed_sockets.update(sockets)

    @asynccontextmanager
    async def hosts(self, base: Path, count: int, **options):
        """`count` hosts on loopback; the first starts the DHT, the others bootstrap from it."""
        started: list[P2PHost] = []
        try:
            for index in range(count):
                identity = NodeIdentity.load_or_create(identity_path(base / f"node{index}"))
                initial = await started[0].maddrs() if started else []
                started.append(self.track_host(await P2PHost.start(identity, initial_peers=initial, **options)))
            yield started
        finally:
            for host in started:
                await host.shutdown()

    def finish(self) -> list[str]:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        deadline = time.monotonic() + 10
        for pid in self.pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        leftovers = sorted(path for path in self.sockets if os.path.exists(path))
        for path in [*leftovers, *self.killed_sockets]:
            with suppress(FileNotFoundError):
                os.remove(path)
        return leftovers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with suppress(OSError):  # a zombie child counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    return True


@pytest.fixture
def p2p_cleanup():
    before = socket_paths()
    cleanup = P2PCleanup()
    yield cleanup
    leftovers = cleanup.finish()
    # a daemon that failed to start was never tracked: a dead socket that appeared meanwhile is
    # its, when this test ran alone; beside another xdist worker it may be that worker's (a
    # SIGKILLed node's, which its harness removes later): removed, but blamed on no one
    untracked = remove_dead_sockets(socket_paths() - before - set(leftovers))
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") == "1":
        leftovers += untracked
    assert not leftovers, f"p2pd sockets left behind by the code under test: {leftovers}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item, so a fixture can tell that its test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def harness_factory(tmp_path_factory, request):
    """Makes swarm harnesses of real daemons (tests/swarm_harness.py, or a subclass such as
    tests/faults.py's FaultHarness) under a short temporary folder, and closes every one at the
    end. When the test failed, prints every node's log tail: the node a test waited on often
    failed because of another one, whose log the assertion does not show.

    Not under tmp_path: that holds the test's name, and under an xdist worker its folder too,
    which made a node's control socket path longer than a unix socket allows (107 bytes)."""
    from tests.swarm_harness import SwarmHarness
    made = []
    base = tmp_path_factory.mktemp("h")

    def make(manifest, name=None, harness_class=SwarmHarness):
        made.append(harness_class(base / (name or manifest.swarm.id), manifest))
        return made[-1]
    yield make
    report = getattr(request.node, "report_call", None)
    for harness in made:
        harness.close()
        if report is not None and report.failed:
            for node in harness.nodes:
                print(f"--- node {node.index} (exit code {node.process.poll()}), log tail:\n"
                      f"{node.log_tail(60)}")
