"""The operator's views on a real local swarm: two `lowcomm-node join` daemons (real p2pd on
loopback) publishing to a real mosquitto. Node 0 runs under the swarm harness; node 1 runs
in the foreground of a detached tmux session (its own `-L` server, fixed size), so that its
rich status view is drawn on a real terminal and read back with `tmux capture-pane`.

- the view shows every field of the issue with live values (160 columns), and stays whole
  at 80 and 56 columns (`lowcomm-node status` attached to the same daemon);
- `lowcomm-node monitor --once` lists every node of the swarm;
- `lowcomm-node status --json` returns the numbers the daemon publishes over MQTT, compared
  at the same status version (`seq`).

Set LOWCOMM_STATUS_CAPTURE=PATH to keep the coloured capture (`capture-pane -e`) that
benchmarks/status_screenshot.py renders to the README's PNG.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiomqtt
import pytest

from node.ops.status import DERIVED
from node.ops.status_view import short_peer
from node.ops.telemetry import parse_mqtt_url, status_topic
from tests.mqtt_broker import MosquittoBroker, require_mosquitto
from tests.swarm_harness import NodeHandle, SwarmHarness, left, small_manifest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "node.cli"]
TMUX = shutil.which("tmux")
SWARM = "sv-swarm"
WIDE, HIGH = 160, 50
SPARK = "[▁▂▃▄▅▆▇█]"
CAPTURE_ENV = "LOWCOMM_STATUS_CAPTURE"


class PaneProcess:
    """The `join` running in the tmux pane (exec'd, so the pane's pid is the daemon's), as
    much of a Popen as NodeHandle needs."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode = None

    def poll(self):
        try:
            os.kill(self.pid, 0)
            with open(f"/proc/{self.pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    self.returncode = 0
        except (ProcessLookupError, FileNotFoundError):
            self.returncode = 0 if self.returncode is None else self.returncode
        return self.returncode


class Tmux:
    """A private tmux server (`-L`): every session it has dies with kill()."""

    def __init__(self):
        self.socket = f"lowcomm-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str, check: bool = True) -> str:
        # The server takes its environment from the first client: without COLUMNS/LINES
        # (pytest sets them), so that programs in a pane see the pane's own size.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
        result = subprocess.run([TMUX, "-L", self.socket, "-f", "/dev/null", *args], env=env,
                                capture_output=True, text=True, timeout=20)
        if check and result.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def new_session(self, name: str, width: int, height: int, command: list[str]) -> int:
        line = "exec " + " ".join(_quote(c) for c in command)
        self("new-session", "-d", "-s", name, "-x", str(width), "-y", str(height), "-c",
             str(REPO), line)
        return int(self("display-message", "-p", "-t", name, "#{pane_pid}").strip())

    def capture(self, name: str, colours: bool = False) -> str:
        return self("capture-pane", "-p", *(["-e"] if colours else []), "-t", name)

    def kill(self) -> None:
        self("kill-server", check=False)
        path = Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / self.socket
        path.unlink(missing_ok=True)


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./=:@+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


# ---- what the view must show -------------------------------------------------------------------
def view_fields(screen: str, me: str, partner: str) -> dict[str, str | None]:
    """Each field of the issue -> the live value read on the screen (None: not shown, or only
    a placeholder)."""
    def find(pattern: str) -> str | None:
        m = re.search(pattern, screen)
        return m.group(1) if m else None

    nonzero = lambda v: v if v and re.search(r"[1-9]", v) else None
    return {
        "identity": me if me in screen else None,
        "swarm": find(rf"swarm ({re.escape(SWARM)})\b"),
        "protocol": find(r"protocol (noloco)\b"),
        "round": nonzero(find(r"\bround +(\d+) ")),
        "step": nonzero(find(r"│ step +(\d+) ")),
        "training loss + trend": find(rf"\bloss +(\d+\.\d{{3}} {SPARK}{{2,}})"),
        "validation loss + trend": find(rf"\bval loss +(\d+\.\d{{3}} {SPARK}{{2,}})"),
        "tokens/s": nonzero(find(r"tokens/s +([\d,]+)")),
        "cpu utilisation": nonzero(find(r"\bcpu +(\d+%)")),
        "memory (rss)": nonzero(find(r"\brss +([\d.]+ [KMG]iB)")),
        "peers known and alive": find(r"peers +(1 alive / 1 known)"),
        "partner": find(rf"partner +({re.escape(short_peer(partner))})"),
        "bytes sent per round": nonzero(find(r"sent/round +([\d.]+ [KMG]?i?B)")),
        "bytes received per round": nonzero(find(r"recv/round +([\d.]+ [KMG]?i?B)")),
        "compression ratio": nonzero(find(r"compression +(\d+\.\dx)")),
        "refused by reason": find(r"Refused.*?\n.*?total +(none|\d+ messages)"),
        "last exchange": find(r"last exchange +(\d+[smhd]\S* ago)"),
        "checkpoint age": find(r"\bage +(\d+[smhd]\S* ago)"),
    }


# ---- the swarm ----------------------------------------------------------------------------
class Swarm:
    def __init__(self, base: Path):
        require_mosquitto()
        self.broker = MosquittoBroker(base)
        self.broker.start()
        m = small_manifest(SWARM, "noloco")
        m.train.eval_every, m.train.checkpoint_every = 20, 20  # every round: live values
        self.harness = SwarmHarness(base / "swarm", m)
        self.tmux = Tmux()
        self.mqtt = ["--mqtt", self.broker.url, "--mqtt-interval", "0.05"]
        self.nodes: list[NodeHandle] = []

    def start(self) -> None:
        first = self.harness.start_node(0, extra=[*self.mqtt, "--min-peers", "1",
                                                  "--max-steps", "3000"])
        first.wait_for(lambda ev: any(e["event"] == "joined" for e in ev), 90, "joining")
        data_dir = self.harness.base / "node-1"
        data_dir.mkdir(parents=True)
        command = [*CLI, "join", "--manifest", str(self.harness.manifest_path), "--data-dir",
                   str(data_dir), "--listen", "/ip4/127.0.0.1/tcp/0", "--peer", first.address,
                   *self.mqtt, "--max-steps", "3000"]
        pid = self.tmux.new_session("view", WIDE, HIGH, command)
        second = NodeHandle(1, data_dir, PaneProcess(pid))
        self.nodes = [first, second]
        second.wait_for(lambda ev: any(e["event"] == "joined" for e in ev), 90, "joining")

    def close(self) -> None:
        try:
            if len(self.nodes) > 1 and self.nodes[1].process.poll() is None:
                os.kill(self.nodes[1].process.pid, signal.SIGTERM)  # checkpoint and leave
                self.nodes[1].wait_for(left, 40, "the tmux node to leave")
        finally:
            self.tmux.kill()
            self.harness.close()  # node 0, and the p2pd sockets of anything killed
            self.broker.stop()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    if TMUX is None:
        pytest.skip("tmux is not installed (bash .ci/setup installs Debian's tmux when run "
                    "as root with apt-get)")
    s = Swarm(tmp_path_factory.mktemp("sv"))
    try:
        s.start()
        yield s
    finally:
        s.close()


def wait_screen(swarm: Swarm, session: str, timeout: float, ready, tmux: Tmux | None = None) -> str:
    tmux = tmux or swarm.tmux
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux.capture(session)
        if ready(screen):
            return screen
        for node in swarm.nodes:
            assert node.process.poll() is None, f"node {node.index} exited:\n{node.log_tail()}"
        time.sleep(0.25)
    raise AssertionError(f"the view did not get there in {timeout} s; screen:\n{screen}")


def test_foreground_view_in_tmux_shows_every_field_live(swarm):
    first, second = swarm.nodes
    me, partner = second.peer_id, first.peer_id
    fields = lambda screen: view_fields(screen, me, partner)
    screen = wait_screen(swarm, "view", 120, lambda s: all(fields(s).values()))
    seen = fields(screen)
    print("fields seen in capture-pane:\n" + "\n".join(f"  {k}: {v}" for k, v in seen.items()))
    lines = screen.splitlines()
    assert len(lines) <= HIGH and max(map(len, lines)) <= WIDE
    # the values are the daemon's: the view's round is one the node has reached. The view counts
    # the next round once a round's last step is done, while that round's end (outer step,
    # swap) is still running and not yet logged: a suite run saw round 5 at step 100 (H = 20)
    # with round 3 the last logged
    rounds = [e["round"] for e in second.events("round")]
    assert int(seen["round"]) <= rounds[-1] + 2
    # NoLoCo swaps θ in int4 (the default): 0.5625 bytes a parameter, 7.11x fewer than fp32
    assert 6.9 <= float(seen["compression ratio"][:-1]) <= 7.3, seen["compression ratio"]
    if os.environ.get(CAPTURE_ENV):
        coloured = swarm.tmux.capture("view", colours=True)
        Path(os.environ[CAPTURE_ENV]).write_text(coloured)


@pytest.mark.parametrize("width", [80, 56])
def test_narrow_terminals_keep_every_field(swarm, width):
    """`lowcomm-node status` attached to the same daemon in a narrower terminal: panels two
    by two at 80 columns, one compact column below; nothing cut, nothing wider."""
    first, second = swarm.nodes
    session, tmux = f"narrow{width}", Tmux()  # a server of its own: its own window size
    try:
        tmux.new_session(session, width, HIGH, [*CLI, "status", "--data-dir",
                                                str(second.data_dir), "--interval", "0.5"])
        labels = ["peer", "swarm", "protocol", "round", "step", "loss", "val loss", "tokens/s",
                  "cpu", "rss", "peers", "partner", "sent/round", "recv/round", "compression",
                  "Refused", "last exchange", "Checkpoint"]
        screen = wait_screen(swarm, session, 60,
                             lambda s: all(re.search(rf"(^|[\s│]){re.escape(l)}\b", s, re.M)
                                           for l in labels) and "1 alive / 1 known" in s,
                             tmux)
        lines = screen.rstrip("\n").splitlines()
        assert max(map(len, lines)) <= width, screen
        assert "…" not in screen.replace(short_peer(first.peer_id), "").replace(
            short_peer(second.peer_id, 10), ""), f"a value was cut:\n{screen}"
        if width < 80:
            assert "╭" not in screen, "the compact layout has no panels"
    finally:
        tmux.kill()


def test_monitor_lists_every_node_of_the_swarm(swarm):
    peers = sorted(node.peer_id for node in swarm.nodes)
    base = [*CLI, "monitor", "--mqtt", swarm.broker.url, "--swarm", SWARM, "--once"]
    deadline = time.monotonic() + 60
    while True:  # until both have published a training status
        out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60,
                             cwd=REPO)
        assert out.returncode == 0, out.stderr
        snapshot = json.loads(out.stdout)
        nodes = snapshot["nodes"]
        if [n["peer_id"] for n in nodes] == peers and all(n["step"] > 0 for n in nodes):
            break
        assert time.monotonic() < deadline, snapshot
    assert snapshot["totals"]["online"] == 2
    table = subprocess.run(base, capture_output=True, text=True, timeout=60, cwd=REPO,
                           env={**os.environ, "COLUMNS": "160"})
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines()
            if any(short_peer(p) in line for p in peers)]
    print(table.stdout)
    assert len(rows) == 2 and all(any(short_peer(p) in r for r in rows) for p in peers)
    assert "2/2 online" in table.stdout


async def _published(url: str, topic: str, into: dict[int, dict], ready: asyncio.Event):
    target = parse_mqtt_url(url)
    async with aiomqtt.Client(target.host, target.port) as client:
        await client.subscribe(topic, qos=1)
        ready.set()
        async for message in client.messages:
            doc = json.loads(message.payload)
            if "seq" in doc:
                into[doc["seq"]] = doc


def test_status_json_returns_what_the_daemon_publishes(swarm):
    """The same status version (`seq`) read two ways: `lowcomm-node status --json` on the
    control socket and the daemon's MQTT message; every number equal."""
    node = swarm.nodes[0]
    topic = status_topic(SWARM, node.peer_id)

    async def main():
        published: dict[int, dict] = {}
        ready = asyncio.Event()
        task = asyncio.create_task(_published(swarm.broker.url, topic, published, ready))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            for attempt in range(20):
                proc = await asyncio.create_subprocess_exec(
                    *CLI, "status", "--json", "--data-dir", str(node.data_dir), cwd=REPO,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                out, err = await asyncio.wait_for(proc.communicate(), 30)
                assert proc.returncode == 0, err.decode()
                local = json.loads(out)
                # the publisher may still be about to send this version: wait (bounded)
                deadline = time.monotonic() + 1.0
                while local["seq"] not in published and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                if local["seq"] in published and local["step"] > 0:
                    return local, published[local["seq"]], attempt + 1
            raise AssertionError(f"no published version matched the control socket's in 20 "
                                 f"tries (last seq {local['seq']}, published "
                                 f"{sorted(published)[-5:]})")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    local, remote, attempts = asyncio.run(main())
    print(f"matched seq {local['seq']} after {attempts} status --json call(s)")
    compared = sorted(set(local) - set(DERIVED))
    assert set(remote) == set(local)
    # how the trainer uses this CPU, and why (node/train/accelerator.py)
    assert (local["precision"], local["compute"]) == (
        "fp32: a CPU trains in fp32",
        "eager (train.compile = auto compiles on CUDA only, and this is cpu)")
    assert local["micro_batch"] >= 1
    assert {k: local[k] for k in compared} == {k: remote[k] for k in compared}
    for key in DERIVED:  # the ages: each computed at its own reading, a moment apart
        if local[key] is None:
            assert remote[key] is None
        else:
            assert abs(local[key] - remote[key]) < 30, key
    assert local["step"] > 0 and local["train_loss"] is not None and local["peer_id"] == node.peer_id
