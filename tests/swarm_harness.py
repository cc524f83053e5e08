"""A local swarm of real `lowcomm-node join` processes for integration tests (and fault injection).

Every node is a separate process with its own p2pd, on loopback, with its own data directory.
Waits read the node's event log (metrics.jsonl) with a bounded timeout: no sleep-and-hope. The
harness kills whatever is still running at the end and removes the p2pd sockets that killed
nodes leave in /tmp, so a test leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from node.config.manifest import Manifest, write_manifest
from node.data_dir import DataDir
from p2p.host import remove_dead_sockets, socket_paths



def small_manifest(swarm: str, protocol: str, inner_steps: int = 20, **protocol_values) -> Manifest:
    """A swarm whose rounds take 1-3 s on a shared CPU core: long enough for a pair to form
    and swap within a round on loopback."""
    m = Manifest()
    m.swarm.id = swarm
    m.model.dim, m.model.n_heads, m.model.n_layers, m.model.ffn_hidden = 64, 4, 2, 128
    m.data.seq_len = 32
    t = m.train
    # DiLoCoX's consensus check reads each member's latest φ digest from the member cache
    # (refreshed every 0.5 s) and may wait 5 s for it: its rounds stay 2-3 s so that a vote is
    # not overwritten by the next round's before it is read. NoLoCo pairs within 0.5 s on
    # loopback, so its steps take half the tokens.
    tokens = 2048 if protocol == "dilocox" else 1024
    t.micro_batch_size, t.tokens_per_step, t.lr, t.warmup_steps = 32, tokens, 1e-2, 10
    t.steps, t.eval_every, t.eval_batches, t.checkpoint_every, t.threads = 2000, 0, 2, 0, 1
    m.protocol.name, m.protocol.inner_steps = protocol, inner_steps
    for key, value in protocol_values.items():
        setattr(m.protocol, key, value)
    return m


# the refusals the 4-node DiLoCoX tests accept from an honest swarm (the relay test's set)
DILOCOX_BENIGN = {"REFUSED", "STALE_ROUND", "TIMEOUT", "REPLAYED"}


def run_to_the_end(harness, count: int, max_steps: int, timeout: float = 300) -> list:
    """`count` nodes started together, each trained `max_steps` steps and left."""
    nodes = harness.start(count, extra=["--max-steps", str(max_steps)])
    for node in nodes:
        node.wait_for(left, timeout, "the node to finish and leave")
    return nodes


def phi_rounds(nodes) -> tuple[list[int], list[int], list[dict[int, str]]]:
    """DiLoCoX nodes' φ by round: (the rounds all of them ended, those of them whose φ was not
    the same on every node, each node's {round: φ digest})."""
    digests = [{r["round"]: r["phi_digest"] for r in node.events("round")} for node in nodes]
    common = sorted(set.intersection(*(set(d) for d in digests)))
    return common, [r for r in common if len({d[r] for d in digests}) > 1], digests


def assert_phi_heals(nodes, min_rounds: int = 3) -> list[int]:
    """DiLoCoX's consistency, as the daemon promises it: the nodes' φ may split for a round (a
    message that reached some of them before a deadline) but the consensus check resyncs the
    minority, so every split is over two rounds later. The last two rounds before the nodes
    left had no time to heal and are not judged. Returns the rounds all nodes ended."""
    common, split, digests = phi_rounds(nodes)
    assert len(common) >= min_rounds, common
    judged = [r for r in split if r + 2 <= common[-1]]
    unhealed = [r for r in judged if r + 2 in common and len({d[r + 2] for d in digests}) > 1]
    assert not unhealed, f"φ still split two rounds after rounds {unhealed}: {digests}"
    assert len(split) <= len(common) // 3, f"φ split in rounds {split} of {common}"
    return common


def assert_one_phi(nodes, delay: int = 1, min_rounds: int = 3) -> list[int]:
    """DiLoCoX's consistency once the swarm has formed (docs/protocols.md §3): only the outer
    step that applies the first round all nodes ended (that round + `delay`) may split φ (a
    member may end that round before it knows of a node that joined late), and its split is
    repaired at the next step; every other round has one φ on every node. Returns the rounds
    all nodes ended."""
    common, split, digests = phi_rounds(nodes)
    assert len(common) >= min_rounds, common
    first_step = common[0] + delay
    assert not [r for r in split if r != first_step], \
        f"φ split in rounds {split} of {common} (only round {first_step} may): {digests}"
    return common


def left(events: list[dict]) -> bool:
    """The node logged its clean exit (the predicate for NodeHandle.wait_for)."""
    return any(e["event"] == "left" for e in events)


class NodeHandle:
    def __init__(self, index: int, data_dir: Path, process: subprocess.Popen):
        self.index, self.data_dir, self.process = index, data_dir, process

    def events(self, kind: str | None = None) -> list[dict]:
        path = DataDir(self.data_dir).metrics
        if not path.exists():
            return []
        found = []
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if kind is None or event["event"] == kind:
                found.append(event)
        return found

    def wait_for(self, predicate, timeout: float, what: str) -> list[dict]:
        """Waits until predicate(events) is true; fails with the node's log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.events()
            if predicate(events):
                return events
            if self.process.poll() is not None and not predicate(self.events()):
                break
            time.sleep(0.1)
        raise AssertionError(f"node {self.index}: timed out after {timeout} s waiting for {what} "
                             f"(exit code {self.process.poll()}); log tail:\n{self.log_tail()}")

    def wait_log(self, text: str, timeout: float) -> str:
        """Waits until the node's log holds `text`; returns the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log_tail(100_000)
            if text in log:
                return log
            time.sleep(0.1)
        raise AssertionError(f"node {self.index}: {text!r} not logged within {timeout} s; "
                             f"log tail:\n{self.log_tail()}")

    def wait_rounds(self, count: int, timeout: float) -> list[dict]:
        self.wait_for(lambda ev: sum(e["event"] == "round" for e in ev) >= count, timeout,
                      f"{count} rounds")
        return self.events("round")

    def log_tail(self, lines: int = 30) -> str:
        path = DataDir(self.data_dir).log
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    @property
    def address(self) -> str:
        return DataDir(self.data_dir).address.read_text().split()[0]

    @property
    def peer_id(self) -> str:
        return self.events("joined")[-1]["peer_id"]


class SwarmHarness:
    # what `python` runs before `join ...`: the daemon's command line, or a wrapper that takes
    # the same arguments (a benchmark's meter) and hands them to node.cli
    entry: tuple[str, ...] = ("-m", "node.cli")

    def __init__(self, base: Path, manifest: Manifest):
        self.base = Path(base)
        self.manifest_path = write_manifest(manifest, self.base / "manifest.toml")
        self.nodes: list[NodeHandle] = []
        self.sockets_before = socket_paths()

    def start_node(self, index: int, peers: list[str] = (), extra: list[str] = (),
                   data_dir: Path | None = None, env: dict[str, str] | None = None) -> NodeHandle:
        """`env`: variables added to the node's environment (e.g. libfaketime's, to skew its clock)."""
        data_dir = data_dir or self.base / f"node-{index}"
        data_dir.mkdir(parents=True, exist_ok=True)
        DataDir(data_dir).address.unlink(missing_ok=True)
        command = [sys.executable, *self.entry, "join", "--manifest", str(self.manifest_path),
                   "--data-dir", str(data_dir), "--listen", "/ip4/127.0.0.1/tcp/0", *extra]
        for peer in peers:
            command += ["--peer", peer]
        with open(DataDir(data_dir).log, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        node = NodeHandle(index, data_dir, process)
        self.nodes.append(node)
        return node

    def start(self, count: int, extra: list[str] = (), timeout: float = 90) -> list[NodeHandle]:
        """Node 0 first; the others bootstrap from it once it has joined. Node 0 waits for the
        others before its first round (--min-peers), so the swarm starts together."""
        first = self.start_node(0, extra=[*extra, "--min-peers", str(count - 1)])
        first.wait_for(lambda ev: any(e["event"] == "joined" for e in ev), timeout, "joining")
        rest = [self.start_node(i, [first.address], extra) for i in range(1, count)]
        for node in rest:
            node.wait_for(lambda ev: any(e["event"] == "joined" for e in ev), timeout, "joining")
        return [first, *rest]

    def kill(self, node: NodeHandle, sig: int = signal.SIGKILL) -> None:
        if node.process.poll() is None:
            node.process.send_signal(sig)
            node.process.wait(timeout=60)

    def stop(self, node: NodeHandle, timeout: float = 40) -> int:
        if node.process.poll() is None:
            node.process.send_signal(signal.SIGTERM)
            try:
                node.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
                raise AssertionError(f"node {node.index} did not exit within {timeout} s of "
                                     f"SIGTERM:\n{node.log_tail()}")
        return node.process.returncode

    def close(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        for node in self.nodes:
            try:
                node.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
        # p2pd of a SIGKILLed node dies with it but leaves its unix sockets behind; delete only
        # those nothing listens on: a test running beside this one owns live ones
        remove_dead_sockets(socket_paths() - self.sockets_before)
