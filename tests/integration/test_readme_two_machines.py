"""The README's "A swarm across two machines", run as written, in two network namespaces.

Machine A and machine B are two namespaces on one bridge (benchmarks/netns.py, an unshaped
1 Gbit/s link), each with its own working directory. The commands are the README's own fenced
blocks (tests/readme_commands.py), run with bash in their machine's namespace, `lowcomm-node`
being this interpreter's; the only change is the one the README asks of the user: the example
address in B's command becomes the line of A's `cat runs/a/address` that holds A's address.
The test passes when each node has applied a swap with the other (a `round` event naming the
other as partner, in its metrics.jsonl). The nodes are then stopped with SIGTERM, as Ctrl-C
would, and every namespace and p2pd socket goes with them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.netns import ShapedLink
from p2p.host import remove_dead_sockets, socket_paths
from tests import readme_commands
from tests.netns_link import available
from tests.swarm_harness import NodeHandle

pytestmark = [pytest.mark.integration, pytest.mark.host_network]  # a veth pair on the host
BIN = Path(sys.executable).parent  # where this venv's lowcomm-node is


def _run(link: ShapedLink, machine: int, cwd: Path, commands: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        return link.popen(machine, ["bash", "-c", "\n".join(commands)], cwd=cwd, env=env,
                          stdout=out, stderr=subprocess.STDOUT)


def _address_to_copy(link: ShapedLink, cwd: Path, commands: list[str], ip: str, daemon: subprocess.Popen,
                     timeout: float = 90) -> str:
    """Runs A's second-terminal block until it prints a line with A's address, as step 3 says."""
    deadline = time.monotonic() + timeout
    printed = ""
    while time.monotonic() < deadline:
        shown = link.popen(0, ["bash", "-c", "\n".join(commands)], cwd=cwd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        printed = shown.communicate(timeout=30)[0]
        lines = [line for line in printed.split() if line.startswith(f"/ip4/{ip}/tcp/")]
        if lines:
            return lines[0]
        if daemon.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"`{'; '.join(commands)}` on machine A printed no address with {ip} "
                         f"within {timeout} s (node A exit code {daemon.poll()}); it printed {printed!r}")


def _stop(processes: list[subprocess.Popen], timeout: float = 40) -> None:
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass  # the namespace set kills what is left


def _swapped_with(node: NodeHandle, other: NodeHandle, timeout: float) -> None:
    node.wait_for(lambda events: any(e["event"] == "round" and e.get("partner") == other.peer_id
                                     for e in events), timeout, f"a round paired with {other.peer_id}")


@pytest.mark.timeout(480)
@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_the_readme_two_machines_steps_make_a_swarm(tmp_path):
    setup = readme_commands.block("on both machines")
    assert any(".ci/setup-run" in c for c in setup.commands)  # what `make test` has already run
    join_a = readme_commands.block("on machine A").commands
    show_a = readme_commands.block("on machine A, second terminal").commands
    join_b = readme_commands.block("on machine B").commands
    machine_a, machine_b = tmp_path / "machine-a", tmp_path / "machine-b"
    machine_a.mkdir()
    machine_b.mkdir()
    sockets_before = socket_paths()
    processes = []
    with ShapedLink(rate="1gbit", subnet="10.76.0") as link:
        try:
            a = _run(link, 0, machine_a, join_a, tmp_path / "a.log")
            processes.append(a)
            address = _address_to_copy(link, machine_a, show_a, link.addr_a, a)
            assert "/tcp/4100/p2p/12D3KooW" in address, address  # the port step 2 opens
            b_commands = [readme_commands.EXAMPLE_ADDRESS.sub(address, c) for c in join_b]
            assert b_commands != join_b, "machine B's command holds no example address to replace"
            b = _run(link, 1, machine_b, b_commands, tmp_path / "b.log")
            processes.append(b)
            node_a = NodeHandle(0, machine_a / "runs" / "a", a)
            node_b = NodeHandle(1, machine_b / "runs" / "b", b)
            node_b.wait_for(lambda events: any(e["event"] == "joined" for e in events), 90, "joined")
            _swapped_with(node_a, node_b, timeout=240)
            _swapped_with(node_b, node_a, timeout=120)
        except AssertionError as failure:
            logs = {name: (tmp_path / name).read_text(errors="replace")[-3000:]
                    for name in ("a.log", "b.log") if (tmp_path / name).exists()}
            raise AssertionError(f"{failure}\nmachine A's output:\n{logs.get('a.log')}\n"
                                 f"machine B's output:\n{logs.get('b.log')}") from None
        finally:
            _stop(processes)
    remove_dead_sockets(socket_paths() - sockets_before)
