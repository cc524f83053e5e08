"""Fault injection on a local swarm of real daemons (issue 8), built on tests/swarm_harness.py.

    harness = FaultHarness(tmp_path / "s", adversary_manifest("t-nan"))
    honest = harness.start(2)
    bad = harness.start_adversary(2, "nan", [honest[0].address])
    ...
    harness.kill_p2pd(honest[1])          # the node's own p2pd, SIGKILL, under it
    with tmpfs(tmp_path / "full", "4m") as small: ...   # a data directory that fills up

Adversaries are real `lowcomm-node join` processes started through `python -m tests.adversary`
(a wrapper that patches one misbehaviour in; the product has no switch for it). Every wait is
bounded and reads the node's metrics.jsonl or node.log; `close()` stops every process it
started, and `tmpfs` always unmounts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from node.config.manifest import Manifest
from node.data_dir import DataDir
from tests.swarm_harness import NodeHandle, SwarmHarness, small_manifest

REPO = Path(__file__).resolve().parents[1]


def adversary_manifest(swarm: str, protocol: str = "noloco", ban_after: int = 2,
                       alignment_check: bool = False, **protocol_values) -> Manifest:
    """small_manifest with a quick ban, so that repeat offences show within a few rounds.
    NoLoCo snapshots send φ and Δ, in bf16, so that each poison reaches the value checks (in
    int8 a NaN or inf is already refused as a malformed scale: tests/unit/test_noloco_wire.py).
    `alignment_check` turns on the check that refuses a Δ pointing nowhere near the node's own
    (off by default, as in the product): only the noise sender's test wants it, since it also
    refuses honest peers once training plateaus (node/rounds/contributions.py). With a ban after
    2 strikes it banned every honest peer of a link-cut test in CI at round ~80."""
    m = small_manifest(swarm, protocol, **protocol_values)
    m.contributions.ban_after = ban_after
    if alignment_check:
        m.contributions.min_alignment_sigmas = 5.0
    m.protocol.snapshot = "phi_delta"
    m.protocol.wire_dtype = protocol_values.get("wire_dtype", "bf16")
    return m


def has(kind: str, count: int = 1, **fields):
    """A predicate for NodeHandle.wait_for: `count` events of `kind` with these field values."""
    def predicate(events: list[dict]) -> bool:
        return sum(e["event"] == kind and all(e.get(k) == v for k, v in fields.items())
                   for e in events) >= count
    return predicate


def joined(events: list[dict]) -> bool:
    return any(e["event"] == "joined" for e in events)


def start_swarm(harness, honest: int, kind: str, extra=()):
    """`honest` honest nodes and one adversary of `kind`; every node waits for all the others
    before round 0, so they start together (a node rounds ahead could not pair)."""
    extra = [*extra, "--min-peers", str(honest)]
    first = harness.start_node(0, extra=extra)
    first.wait_for(joined, 90, "joining")
    nodes = [first] + [harness.start_node(i, [first.address], extra) for i in range(1, honest)]
    bad = harness.start_node(honest, [first.address], extra, adversary=kind)
    for node in [*nodes[1:], bad]:
        node.wait_for(joined, 90, "joining")
    return nodes, bad


def finished(events: list[dict]) -> bool:
    return any(e["event"] == "left" for e in events)


class FaultHarness(SwarmHarness):
    """SwarmHarness whose nodes may run under the adversary wrapper."""

    def start_node(self, index: int, peers: list[str] = (), extra: list[str] = (),
                   data_dir: Path | None = None, adversary: str | None = None,
                   env: dict | None = None, listen: str = "/ip4/127.0.0.1/tcp/0",
                   netns: str | None = None) -> NodeHandle:
        """`netns`: run the node inside that network namespace (tests/netns_link.py)."""
        data_dir = data_dir or self.base / f"node-{index}"
        data_dir.mkdir(parents=True, exist_ok=True)
        DataDir(data_dir).address.unlink(missing_ok=True)
        entry = ["-m", "tests.adversary", "--kind", adversary, "--"] if adversary else ["-m", "node.cli"]
        command = [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, *entry,
                   "join", "--manifest", str(self.manifest_path), "--data-dir", str(data_dir),
                   "--listen", listen, *extra]
        for peer in peers:
            command += ["--peer", peer]
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [environment.get("PYTHONPATH")])])
        with open(DataDir(data_dir).log, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                       env=environment)
        node = NodeHandle(index, data_dir, process)
        self.nodes.append(node)
        return node

    def start_adversary(self, index: int, kind: str, peers: list[str], extra: list[str] = (),
                        timeout: float = 90, env: dict | None = None) -> NodeHandle:
        node = self.start_node(index, peers, extra, adversary=kind, env=env)
        node.wait_for(joined, timeout, "joining")
        return node

    # ------------------------------------------------------------------ faults
    @staticmethod
    def p2pd_pid(node: NodeHandle) -> int:
        """The node's own p2pd: its child process named p2pd."""
        pid = node.process.pid
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                if "p2pd" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode():
                    return int(child)
        raise AssertionError(f"node {node.index} has no p2pd child")

    def kill_p2pd(self, node: NodeHandle) -> int:
        pid = self.p2pd_pid(node)
        os.kill(pid, signal.SIGKILL)
        return pid


def two_nodes_and_a_killed_adversary(harness: FaultHarness, kind: str, victim_log: str
                                     ) -> tuple[list[NodeHandle], NodeHandle, float]:
    """Two honest nodes, then a `kind` adversary that SIGKILLs itself at its fault point and
    logs `victim_log` there: the survivors, the dead node and when it died."""
    extra = ["--min-peers", "2"]
    first = harness.start_node(0, extra=extra)
    first.wait_for(joined, 90, "joining")
    second = harness.start_node(1, [first.address], extra)
    second.wait_for(joined, 90, "joining")
    victim = harness.start_adversary(2, kind, [first.address], extra)
    assert wait_exit(victim, 180) == -signal.SIGKILL, victim.log_tail()
    killed_at = time.time()
    assert victim_log in victim.log_tail(100_000)
    return [first, second], victim, killed_at


def stop_all(nodes: list[NodeHandle], timeout: float = 40) -> list[int]:
    """SIGTERM to every node at once, then their exit codes (each must leave within `timeout`)."""
    for node in nodes:
        if node.process.poll() is None:
            node.process.send_signal(signal.SIGTERM)
    return [wait_exit(node, timeout) for node in nodes]


def wait_exit(node: NodeHandle, timeout: float) -> int:
    """The node's exit code; fails with its log tail if it is still running after `timeout`."""
    try:
        return node.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"node {node.index} still running after {timeout} s:\n"
                             f"{node.log_tail()}") from None


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (needs root), always unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        for _ in range(50):  # a process that just died may still hold a file for a moment
            if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def can_mount() -> bool:
    return os.geteuid() == 0


def timeline(nodes: list[NodeHandle], since: float = 0.0) -> str:
    """Each node's rounds after `since` in one line apiece (partner initial or '.', members
    alive) plus its exchange failures: what a failing fault test prints, since a node's log
    tail shows only one side of an exchange."""
    lines = []
    for node in nodes:
        rounds = "".join((r.get("partner") or ".")[-1] + str(r.get("peers_alive", "?"))
                         for r in node.events("round") if r["time"] > since)
        failures = [(round(e["time"] - since, 1), e["event"], (e.get("partner") or "")[-6:])
                    for e in node.events() if e["time"] > since
                    and e["event"] in ("swap_failed", "swap_late", "no_partner")]
        lines.append(f"node {node.index}: rounds {rounds}; failures {failures[-12:]}")
    log_lines = [line for node in nodes for line in node.log_tail(100_000).splitlines()
                 if "lowcomm.members" in line or "redialled" in line or "match propose" in line]
    return "\n".join([*lines, *log_lines[-20:]])
