"""`small` nodes on home-like links: three members train, a fourth joins late, and the member
serving it is killed mid-transfer.

Four `lowcomm-node join` daemons of the `small` preset (85M parameters with the stdlib corpus'
byte vocabulary; a short sequence and micro-batch so that a step takes about a second of this
CPU) in network namespaces (benchmarks/netns.py): members 0-2 on access links of 100, 8 and 25
Mbit/s (each way, tbf), every link 40 ms one way (the delaying relay), and node 3 joining over
25 Mbit/s once every member has ended `--join-after-rounds` rounds. When the joiner has
received `--kill-at` of one state, the member that sent the most since it started (the one
serving it) is SIGKILLed; the joiner resumes from another member. The run ends when the
joiner has ended `--rounds-after-join` rounds, or at `--deadline-s`.

Per node: exchanges completed and failed (NoLoCo: swaps received and failed; DiLoCoX: the
members' messages applied and those missing at a round's end), the best sustained rate (10 s)
it sent and received at against its link, and its peak RSS (VmHWM). The joiner: the bytes it
fetched against one state, its servers, its download time against bytes / link rate.

    flock /tmp/lowcomm-heavy.lock .venv/bin/python benchmarks/small_links.py --protocol noloco
    flock /tmp/lowcomm-heavy.lock .venv/bin/python benchmarks/small_links.py --protocol dilocox \
        --links 100mbit,25mbit,25mbit --join-after-rounds 1 --deadline-s 480   # what fits 24 GiB

Needs root (namespaces) and memory: a `small` node peaks at 6-8.5 GiB here, so the default
four daemons need about 30 GiB (on a 24 GiB machine the kernel kills a member); `--links` with
two members and the joiner fits. Writes benchmarks/small_links_<protocol>.json (or --out) and
prints the tables for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.netns import ShapedSwarm, rate_bits  # noqa: E402
from benchmarks.time_to_loss import P2P_PORT, PYTHON, RELAY_PORT, read_events, wait_for_file  # noqa: E402
from node.config.manifest import Manifest, manifest_from_dict, write_manifest  # noqa: E402

LINKS = "100mbit,8mbit,25mbit,25mbit"  # the members', then the late joiner's (the last)
WINDOW_S = 10.0  # a rate is the best one sustained over this long


def swarm_manifest(args) -> Manifest:
    """The `small` preset at a CPU's size of step, every member's link at least the slowest given."""
    tokens = args.micro_batch * args.seq_len
    return manifest_from_dict({
        "swarm": {"id": f"small-links-{args.protocol}"},
        "model": {"preset": "small"},
        "data": {"seq_len": args.seq_len},
        "train": {"micro_batch_size": args.micro_batch, "tokens_per_step": tokens, "steps": 100_000,
                  "warmup_steps": 10, "threads": 1, "eval_every": 0, "checkpoint_every": 0},
        # the swarm declares its slowest link: a transfer that cannot finish by its need-by even
        # at this rate is given up at once (p2p/progress.py), so the default 1 Mbit/s cut every
        # 48 MB swap of `small` at its start (its 4 rounds are about 2 minutes here)
        "protocol": {"name": args.protocol, "inner_steps": args.inner_steps,
                     "min_link_mbit_s": min(rate_bits(r) for r in args.links.split(",")) / 1e6}})


class Run:
    """The swarm's processes and what is sampled of them each second."""

    def __init__(self, net: ShapedSwarm, base: Path, manifest_path: Path, min_peers: int):
        self.net, self.base, self.manifest_path, self.min_peers = net, base, manifest_path, min_peers
        self.processes: dict[int, subprocess.Popen] = {}
        self.first_address: str | None = None
        self.samples: list[dict] = []  # {"t", "tx": [...], "rx": [...]}
        self.hwm: dict[int, int] = {}  # node -> peak VmHWM seen, bytes

    def start(self, i: int) -> None:
        data_dir = self.base / f"node-{i}"
        data_dir.mkdir(parents=True)
        self.net.relay(i, RELAY_PORT, ("127.0.0.1", P2P_PORT))
        command = [PYTHON, "-m", "node.cli", "join", "--manifest", str(self.manifest_path),
                   "--data-dir", str(data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{P2P_PORT}",
                   "--announce", f"/ip4/{self.net.address(i)}/tcp/{RELAY_PORT}"]
        command += ["--min-peers", str(self.min_peers)] if self.first_address is None else ["--peer", self.first_address]
        with open(data_dir / "node.log", "wb") as log:
            self.processes[i] = self.net.popen(i, command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        if self.first_address is None:
            self.first_address = wait_for_file(data_dir / "address", list(self.processes.values()), 300)

    def events(self, i: int) -> list[dict]:
        """Node i's events so far (a line still being written is left out)."""
        path = self.base / f"node-{i}" / "metrics.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        return read_events(path) if text.endswith("\n") or not text else \
            [json.loads(line) for line in text.splitlines()[:-1] if line.strip()]

    def rounds(self, i: int) -> int:
        return sum(e["event"] == "round" for e in self.events(i))

    def sample(self) -> None:
        tx, rx = [], []
        for i in range(self.net.n):
            stats = json.loads(subprocess.run(["ip", "-n", self.net.namespaces[i], "-j", "-s", "link", "show",
                                               "eth0"], capture_output=True, text=True).stdout)[0]["stats64"]
            tx.append(stats["tx"]["bytes"])
            rx.append(stats["rx"]["bytes"])
        self.samples.append({"t": time.monotonic(), "tx": tx, "rx": rx})
        for i, process in self.processes.items():
            if process.poll() is None and (hwm := vm_hwm(process.pid)):
                self.hwm[i] = max(self.hwm.get(i, 0), hwm)

    def kill(self, i: int) -> None:
        os.killpg(self.processes[i].pid, signal.SIGKILL)

    def best_rate(self, i: int, direction: str) -> float:
        """Bits per second node i sustained over WINDOW_S at best, sending or receiving."""
        best, s = 0.0, self.samples
        for a in range(len(s)):
            b = next((k for k in range(a + 1, len(s)) if s[k]["t"] - s[a]["t"] >= WINDOW_S), None)
            if b is None:
                break
            best = max(best, 8 * (s[b][direction][i] - s[a][direction][i]) / (s[b]["t"] - s[a]["t"]))
        return best


def vm_hwm(group: int) -> int:
    """The peak resident memory (VmHWM, bytes) of the daemon in process group `group` (the
    python process running node.cli; p2pd and the relay are left out)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != group:
                continue
            if b"node.cli" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM"))
            return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return 0


def exchanges(events: list[dict], protocol: str) -> tuple[int, int]:
    """(completed, failed) exchanges of a node, as its events tell them."""
    if protocol == "noloco":
        return (sum(e["event"] == "swapped" for e in events),
                sum(e["event"] in ("swap_failed", "swap_late") for e in events))
    applied = sum(max(0, len(e.get("group") or []) - 1) for e in events if e["event"] == "round")
    return applied, sum(len(e.get("peers") or []) for e in events if e["event"] == "missing")


def run(args) -> dict:
    manifest = swarm_manifest(args)
    links = args.links.split(",")
    joiner = len(links) - 1
    with tempfile.TemporaryDirectory(prefix="lowcomm-small-links-") as tmp:
        base = args.work_dir or Path(tmp)
        path = write_manifest(manifest, base / "manifest.toml")
        net = ShapedSwarm(n=len(links), delay_ms=args.delay_ms, rates=dict(enumerate(links)))
        with net:
            swarm = Run(net, base, path, min_peers=joiner - 1)
            started = time.monotonic()
            for i in range(joiner):
                swarm.start(i)
            found = {"killed": None, "killed_at_bytes": None, "join_started_s": None, "joined_s": None,
                     "ended": "deadline"}
            join_rx = join_tx = None
            while time.monotonic() - started < args.deadline_s:
                time.sleep(1.0)
                swarm.sample()
                now = time.monotonic() - started
                exited = [(i, p.returncode) for i, p in swarm.processes.items()
                          if i != found["killed"] and p.poll() is not None]
                if exited:
                    found["ended"] = f"node {exited[0][0]} exited with {exited[0][1]}"
                    break
                if joiner not in swarm.processes:
                    if min(swarm.rounds(i) for i in range(joiner)) >= args.join_after_rounds:
                        swarm.start(joiner)
                        found["join_started_s"] = now
                        join_rx, join_tx = swarm.samples[-1]["rx"][joiner], list(swarm.samples[-1]["tx"])
                    continue
                events = swarm.events(joiner)
                if found["joined_s"] is None and any(e["event"] == "late_join" for e in events):
                    found["joined_s"] = now
                received = swarm.samples[-1]["rx"][joiner] - join_rx
                if found["killed"] is None and found["joined_s"] is None \
                        and received >= args.kill_at * args.state_bytes:
                    sent = [swarm.samples[-1]["tx"][i] - join_tx[i] for i in range(joiner)]
                    found["killed"] = max(range(joiner), key=sent.__getitem__)
                    found["killed_at_bytes"] = received
                    found["killed_s"] = now
                    swarm.kill(found["killed"])
                if found["joined_s"] is not None and swarm.rounds(joiner) >= args.rounds_after_join:
                    found["ended"] = "the joiner trained its rounds"
                    break
            wall = time.monotonic() - started
        nodes = []
        for i in range(len(links)):
            events = swarm.events(i)
            done, failed = exchanges(events, args.protocol)
            link = rate_bits(links[i])
            up, down = swarm.best_rate(i, "tx"), swarm.best_rate(i, "rx")
            nodes.append({"node": i, "link": links[i], "rounds": swarm.rounds(i), "exchanges": done,
                          "exchanges_failed": failed, "up_bits_s": up, "down_bits_s": down,
                          "up_share": up / link, "down_share": down / link,
                          "peak_rss_bytes": swarm.hwm.get(i, 0), "killed": found["killed"] == i,
                          "late_join": next((e for e in events if e["event"] == "late_join"), None),
                          "errors": [e for e in events if e["event"] in ("failed", "task_failed", "send_failed")][:5]})
        return {"args": {k: str(v) for k, v in vars(args).items()}, "wall_s": wall, "found": found,
                "nodes": nodes, "manifest_digest": manifest.digest}


def report(result: dict, args) -> str:
    links = args.links.split(",")
    joiner = len(links) - 1
    lines = ["| node | link | rounds | exchanges done / failed | best send rate (share of link) | "
             "best receive rate (share) | peak RSS |", "|---|---|---|---|---|---|---|"]
    for n in result["nodes"]:
        role = " (joiner)" if n["node"] == joiner else " (killed)" if n["killed"] else ""
        lines.append(f"| {n['node']}{role} | {n['link']} | {n['rounds']} | {n['exchanges']} / "
                     f"{n['exchanges_failed']} | {n['up_bits_s'] / 1e6:.1f} Mbit/s ({100 * n['up_share']:.0f}%) | "
                     f"{n['down_bits_s'] / 1e6:.1f} Mbit/s ({100 * n['down_share']:.0f}%) | "
                     f"{n['peak_rss_bytes'] / 2**30:.2f} GiB |")
    joined = result["nodes"][joiner]["late_join"]
    if joined:
        ideal = 8 * joined["state_bytes"] / rate_bits(links[joiner])
        lines.append(f"\njoiner: {joined['bytes_fetched'] / 1e6:.1f} MB fetched for a state of "
                     f"{joined['state_bytes'] / 1e6:.1f} MB ({joined['bytes_fetched'] / joined['state_bytes']:.3f}x) "
                     f"from {len(joined['sources'])} member(s); download {joined['download_s']:.0f} s against "
                     f"{ideal:.0f} s at its link's rate ({ideal / joined['download_s']:.0%} of line rate)")
    else:
        lines.append("\njoiner: did not join")
    lines.append(f"killed: node {result['found']['killed']} at {result['found']['killed_at_bytes']} bytes "
                 f"received by the joiner; run ended: {result['found']['ended']} after {result['wall_s']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--protocol", choices=("noloco", "dilocox"), default="noloco")
    p.add_argument("--links", default=LINKS, help="access links (tc rates), the members' then the joiner's")
    p.add_argument("--delay-ms", type=float, default=40.0)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--join-after-rounds", type=int, default=2)
    p.add_argument("--rounds-after-join", type=int, default=2)
    p.add_argument("--kill-at", type=float, default=0.3, help="share of one state the joiner has received")
    p.add_argument("--deadline-s", type=float, default=840.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args()
    from node.train.model import build_model, count_parameters
    manifest = swarm_manifest(args)
    args.state_bytes = 8 * count_parameters(build_model(manifest.model, 256, "meta"))
    args.out = args.out or REPO / "benchmarks" / f"small_links_{args.protocol}.json"
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(report(result, args))


if __name__ == "__main__":
    main()
