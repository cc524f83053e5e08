"""`lowcomm-node local-swarm --nodes N`: N daemons on loopback, shown together.

Each node is a real `lowcomm-node join` process with its own data directory under the base
directory; node 0 starts first and writes its address, the others bootstrap from it. The view
reads each node's event log (metrics.jsonl), so it shows what the daemons themselves report.
Ctrl-C (or SIGTERM) asks every node to leave cleanly, waits the grace period, and kills only
what is still running after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from node.data_dir import DataDir

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass
class NodeProcess:
    index: int
    data_dir: Path
    process: subprocess.Popen
    events: dict = field(default_factory=dict)  # latest event of each kind
    offset: int = 0

    def poll_events(self) -> None:
        log = DataDir(self.data_dir).metrics
        if not log.exists():
            return
        with open(log, encoding="utf-8") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break  # a line still being written: read it next time
                self.offset += len(line.encode())
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.events[event.get("event")] = event


def wait_for_address(data_dir: Path, process: subprocess.Popen, timeout: float) -> str:
    layout = DataDir(data_dir)
    path = layout.address
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"node 0 exited with code {process.returncode} before it was "
                               f"reachable: see {layout.log}")
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        time.sleep(0.1)
    raise RuntimeError(f"node 0 did not write {path} within {timeout:.0f} s: see {layout.log}")


DEFAULT_NODES = 3


def gpu_arguments(gpus: str | None, nodes: int | None) -> list[list[str]]:
    """Each node's own `join` arguments: `--gpu N` for the i-th GPU of `gpus` ("0,1,..."), or
    none; one list per node. ValueError in one sentence for a GPU this machine lacks, or a
    --nodes that is not one per GPU."""
    if gpus is None:
        return [[] for _ in range(DEFAULT_NODES if nodes is None else nodes)]
    from node.config.schema import ConfigError
    from node.train.accelerator import gpu_device, parse_gpus
    indices = parse_gpus(gpus)
    if nodes is not None and nodes != len(indices):
        raise ConfigError(f"--nodes {nodes} and --gpus {gpus} differ: each node gets one GPU, so "
                         f"give {len(indices)} nodes or leave --nodes out")
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index in indices:
        gpu_device(index, count, f"--gpus {gpus}")
    return [["--gpu", str(index)] for index in indices]


def join_command(data_dir: Path, join_args: list[str], peers: list[str]) -> list[str]:
    command = [sys.executable, "-m", "node.cli", "join", "--data-dir", str(data_dir),
               "--listen", LOOPBACK, *join_args]
    for peer in peers:
        command += ["--peer", peer]
    return command


def start_node(index: int, base: Path, join_args: list[str], peers: list[str]) -> NodeProcess:
    data_dir = base / f"node-{index}"
    data_dir.mkdir(parents=True, exist_ok=True)
    DataDir(data_dir).address.unlink(missing_ok=True)
    command = join_command(data_dir, join_args, peers)
    log = open(DataDir(data_dir).log, "ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    return NodeProcess(index, data_dir, process)


def swarm_view(nodes: list[NodeProcess]) -> Table:
    table = Table(title="lowcomm-node local swarm", expand=False)
    for column in ("node", "state", "round", "step", "loss", "val loss", "tok/s", "partner/group",
                   "peers"):
        table.add_column(column, justify="right" if column not in ("node", "state") else "left")
    for node in nodes:
        step, rnd, joined = (node.events.get(k, {}) for k in ("step", "round", "joined"))
        code = node.process.poll()
        state = "running" if code is None else f"exited {code}"
        partner = rnd.get("partner") or ",".join(p[-6:] for p in rnd.get("group", [])[:3]) or "-"
        table.add_row(f"{node.index} {joined.get('peer_id', '')[-8:]}", state,
                      str(step.get("round", "-")), str(step.get("step", "-")),
                      f"{step['loss']:.3f}" if "loss" in step else "-",
                      f"{rnd['val_loss']:.3f}" if "val_loss" in rnd else "-",
                      f"{step['tokens_per_second']:,.0f}" if "tokens_per_second" in step else "-",
                      partner[-14:] if rnd.get("partner") else partner,
                      str(rnd.get("peers_alive", "-")))
    return table


def stop_all(nodes: list[NodeProcess], grace_s: float) -> None:
    for node in nodes:
        if node.process.poll() is None:
            node.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for node in nodes:
        try:
            node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()


def run_local_swarm(count: int, base: Path, join_args: list[str], grace_s: float,
                    console: Console | None = None, node_args: list[list[str]] | None = None) -> int:
    """`node_args[i]`: node i's own join arguments after the shared ones (its --gpu)."""
    console = console or Console()
    own = node_args or [[] for _ in range(count)]
    nodes: list[NodeProcess] = []
    stopping = []
    previous = {sig: signal.signal(sig, lambda *_: stopping.append(True))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # node 0 waits for the others before round 0, so the first rounds have partners
        nodes.append(start_node(0, base, [*join_args, *own[0], "--min-peers", str(count - 1)], []))
        address = wait_for_address(nodes[0].data_dir, nodes[0].process, timeout=60)
        console.print(f"node 0 is up at {address}; starting {count - 1} more")
        nodes.extend(start_node(i, base, [*join_args, *own[i]], [address]) for i in range(1, count))
        with Live(swarm_view(nodes), console=console, refresh_per_second=2,
                  auto_refresh=console.is_terminal) as live:
            while not stopping and any(n.process.poll() is None for n in nodes):
                for node in nodes:
                    node.poll_events()
                live.update(swarm_view(nodes))
                if not console.is_terminal:
                    time.sleep(5)  # plain output: one table every few seconds is enough
                    console.print(swarm_view(nodes))
                else:
                    time.sleep(0.5)
        failed = [n for n in nodes if n.process.poll() not in (None, 0)]
        return 1 if failed else 0
    finally:
        stop_all(nodes, grace_s)
        for node in nodes:
            node.poll_events()
        if nodes:
            console.print(swarm_view(nodes))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
