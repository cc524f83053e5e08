"""Soak run (issue 8): a 4-node NoLoCo swarm of real daemons for `--minutes`, a random fault every
minute, and the health of the nodes that are never faulted.

    sudo .venv/bin/python benchmarks/soak.py                    # 20 minutes, a fault a minute
    sudo .venv/bin/python benchmarks/soak.py --minutes 3 --fault-every 30   # a quick look
    sudo .venv/bin/python benchmarks/soak.py --snapshot phi_delta --out benchmarks/soak_noise_check.json
                                         # with the noise check applied (issue 24)

Nodes 0 and 1 are steady: nothing is done to them, and their daemon and p2pd are sampled every
`--sample-every` seconds for resident memory, open file descriptors and sockets. Nodes 2 and 3
take the faults (tests/faults.py, tests/netns_link.py), chosen at random (seeded):
- `sigkill`: SIGKILL, restarted 5 s later from its data directory;
- `p2pd`: its own p2pd SIGKILLed under it; the node exits with its one-sentence reason and is
  restarted;
- `sigterm`: a graceful leave, restarted 5 s later;
- `cut`: node 3 lives in its own network namespace; its link goes down for 20 s, then up
  (only as root; otherwise the other three faults only).
A fault's window runs from 5 s before the fault (a pair formed just before it may still be
swapping) until 30 s after the node is back (restarted and started training, or its link
restored). Exchange success counts every pair formed by any node (a
`paired` event) whose swap either landed (`swapped`) or failed (`swap_failed` / `swap_late`),
leaving out pairs with a faulted node inside its window, and counting apart the half-formed pairs
the partner cancelled (`pair_cancelled`: it gave its proposal up before our accept arrived, and
the node looked for another partner in the same round; protocol/matching.py I6). Growth is measured from the end of the
warm-up (`--warmup` minutes) to the end of the run: the median of the samples in the minute after
the warm-up against the median of the last three.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests import netns_link  # noqa: E402
from tests.faults import FaultHarness, has, stop_all  # noqa: E402
from tests.swarm_harness import small_manifest  # noqa: E402

STEADY, FAULTED = (0, 1), (2, 3)
BEFORE_MARGIN_S, BACK_MARGIN_S = 5.0, 30.0


def process_health(pid: int) -> dict:
    """Resident memory (bytes), open fds and sockets of one process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return {"rss": rss, "fds": len(fds), "sockets": sockets}


class Soak:
    def __init__(self, args: argparse.Namespace, base: Path, link):
        self.args, self.link, self.rng = args, link, random.Random(args.seed)
        m = small_manifest("soak", "noloco")
        m.protocol.snapshot = args.snapshot  # "phi_delta": the noise check applies (issue 24)
        m.contributions.noise_ratio = args.noise_ratio
        m.train.steps = 10**6
        m.train.checkpoint_every = 40  # checkpoints are written (and may be killed) all run long
        self.harness = FaultHarness(base, m)
        self.nodes: dict[int, object] = {}
        self.windows: list[dict] = []   # {"node", "peer", "fault", "start", "end"}
        self.samples: list[dict] = []

    # ------------------------------------------------------------------ the swarm
    def listen(self, index: int) -> str:
        if self.link is None:
            return "/ip4/127.0.0.1/tcp/0"
        return self.link.inner_listen if index == 3 else self.link.host_listen

    def start(self, index: int, peers: list[str]) -> object:
        extra = ["--min-peers", "3"] if index == 0 and not peers else []
        in_namespace = self.link is not None and index == 3
        node = self.harness.start_node(index, peers, extra, listen=self.listen(index),
                                       netns=self.link.namespace if in_namespace else None)
        self.nodes[index] = node
        return node

    def bootstrap(self) -> list[str]:
        first = self.nodes[0]
        addresses = (first.data_dir / "address").read_text().split()
        wanted = self.link.host_address if self.link else "127.0.0.1"
        return [next(a for a in addresses if wanted in a)]

    def launch(self) -> None:
        self.start(0, []).wait_for(has("joined"), 90, "node 0 to join")
        for i in (1, 2, 3):
            self.start(i, self.bootstrap()).wait_for(has("joined"), 90, f"node {i} to join")
        for node in self.nodes.values():
            node.wait_for(has("started"), 120, "training to start")

    # ------------------------------------------------------------------ faults
    def fault(self) -> None:
        kinds = ["sigkill", "p2pd", "sigterm"] + (["cut"] if self.link else [])
        kind = self.rng.choice(kinds)
        index = 3 if kind == "cut" else self.rng.choice(FAULTED)
        node = self.nodes[index]
        window = {"node": index, "peer": node.peer_id, "fault": kind, "start": time.time()}
        print(f"{time.strftime('%H:%M:%S')} fault {kind} on node {index}", flush=True)
        if kind == "cut":
            self.link.cut()
            time.sleep(20)
            self.link.restore()
            window["end"] = time.time() + BACK_MARGIN_S
        else:
            if kind == "sigkill":
                self.harness.kill(node)
            elif kind == "p2pd":
                self.harness.kill_p2pd(node)
                node.process.wait(timeout=60)  # it notices and exits with its reason
            else:
                self.harness.stop(node, timeout=40)
            window["exit_code"] = node.process.returncode
            time.sleep(5)
            started_before = len(node.events("started"))
            restarted = self.start(index, self.bootstrap())
            restarted.wait_for(has("started", started_before + 1), 180, "the restarted node to train")
            window["end"] = time.time() + BACK_MARGIN_S
        self.windows.append(window)

    # ------------------------------------------------------------------ health
    def sample(self) -> None:
        row = {"time": time.time()}
        for index in STEADY:
            node = self.nodes[index]
            row[f"node{index}"] = process_health(node.process.pid)
            row[f"p2pd{index}"] = process_health(self.harness.p2pd_pid(node))
        self.samples.append(row)

    def run(self) -> dict:
        self.launch()
        began = time.time()
        end = began + self.args.minutes * 60
        next_fault, next_sample = began + self.args.fault_every, began
        while time.time() < end:
            for index in STEADY:
                if self.nodes[index].process.poll() is not None:
                    raise RuntimeError(f"steady node {index} exited:\n{self.nodes[index].log_tail()}")
            now = time.time()
            if now >= next_sample:
                self.sample()
                next_sample = now + self.args.sample_every
            if now >= next_fault:
                self.fault()
                next_fault = max(next_fault + self.args.fault_every, time.time() + 10)
            time.sleep(max(0.0, min(next_sample, next_fault, end) - time.time()))
        self.sample()
        self.ended = time.time()
        codes = stop_all(list(self.nodes.values()), timeout=60)
        return self.report(began, codes)

    def report(self, began: float, codes: list[int]) -> dict:
        warm = began + self.args.warmup * 60
        after = [s for s in self.samples if warm <= s["time"] < warm + 60] or \
            [s for s in self.samples if s["time"] >= warm][:2]
        last = self.samples[-3:]
        growth = {}
        for key in (k for k in self.samples[0] if k != "time"):
            base = {m: statistics.median(s[key][m] for s in after) for m in ("rss", "fds", "sockets")}
            final = {m: statistics.median(s[key][m] for s in last) for m in ("rss", "fds", "sockets")}
            peak = {m: max(s[key][m] for s in self.samples if s["time"] >= warm) for m in ("fds", "sockets")}
            growth[key] = {"rss_mib": [base["rss"] / 2**20, final["rss"] / 2**20],
                           "rss_growth": final["rss"] / base["rss"] - 1,
                           "fds": [base["fds"], final["fds"], peak["fds"]],
                           "sockets": [base["sockets"], final["sockets"], peak["sockets"]]}
        exchanges = self.exchanges()
        return {"minutes": self.args.minutes, "faults": self.windows, "exit_codes": codes,
                "health": growth, "exchanges": exchanges, "pairing": self.pairing(),
                "samples": self.samples}

    def pairing(self) -> dict:
        """Per node: rounds, rounds ended with a partner, jumps to the swarm's round. The success
        rate counts only pairs formed; a node that never pairs shows here (the first soak after
        the memory fix had one: 0 of 792 rounds, 15 rounds behind the others from its start)."""
        result = {}
        for node in self.nodes.values():
            rounds = node.events("round")
            refused = [s for r in rounds for s in (r.get("refused") or [])]
            result[f"node{node.index}"] = {"rounds": len(rounds),
                                           "with_partner": sum(bool(r.get("partner")) for r in rounds),
                                           "caught_up": sum(r.get("caught_up_to") is not None for r in rounds),
                                           # every node is honest: each refusal is one of an honest peer
                                           "contributions_refused": len(refused),
                                           "refused_as_noise": sum("looks like noise" in s for s in refused),
                                           "refusals": refused[:10]}
        return result

    def in_window(self, peer: str, at: float) -> bool:
        return any(w["peer"] == peer and w["start"] - BEFORE_MARGIN_S <= at <= w["end"] for w in self.windows)

    def exchanges(self) -> dict:
        ok = failed = excluded = cancelled = 0
        failures = []
        for node in self.nodes.values():
            me = node.peer_id
            events = node.events()
            outcomes = {(e["round"], e["partner"]): e for e in events
                        if e["event"] in ("swapped", "swap_failed", "swap_late", "pair_cancelled")}
            for e in (e for e in events if e["event"] == "paired"):
                key = (e["round"], e["partner"])
                if e["time"] > self.ended - BACK_MARGIN_S:
                    continue  # formed as the run stopped: its swap may not have had the time
                if self.in_window(me, e["time"]) or self.in_window(e["partner"], e["time"]):
                    excluded += 1
                elif key in outcomes and outcomes[key]["event"] == "swapped":
                    ok += 1
                elif key in outcomes and outcomes[key]["event"] == "pair_cancelled":
                    cancelled += 1
                else:
                    failed += 1
                    failures.append({"node": node.index, **outcomes.get(key, e)})
        total = ok + failed
        return {"ok": ok, "failed": failed, "excluded_in_fault_windows": excluded,
                "cancelled_half_formed": cancelled,
                "success_rate": ok / total if total else None, "failures": failures[:20]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=3.0, help="minutes before growth is measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/lowcomm-soak"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "soak.json")
    parser.add_argument("--snapshot", choices=("theta", "phi_delta"), default="theta",
                        help="protocol.snapshot; the noise check needs phi_delta")
    parser.add_argument("--noise-ratio", type=float, default=0.1, help="contributions.noise_ratio")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    base = Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S")
    use_link = netns_link.available() is None
    with (netns_link.NamespaceLink() if use_link else contextlib.nullcontext()) as link:
        soak = Soak(args, base, link)
        try:
            result = soak.run()
        finally:
            soak.harness.close()
    args.out.write_text(json.dumps(result, indent=1))
    print(f"faults: {len(result['faults'])} ({', '.join(w['fault'] for w in result['faults'])}); "
          f"exit codes at the end {result['exit_codes']}")
    print("| process | RSS after warm-up -> end (MiB) | growth | fds (after warm-up, end, peak) "
          "| sockets (after warm-up, end, peak) |")
    print("|---|---|---|---|---|")
    for key, h in result["health"].items():
        print(f"| {key} | {h['rss_mib'][0]:.0f} -> {h['rss_mib'][1]:.0f} | {h['rss_growth']:+.1%} | "
              f"{', '.join(map(str, h['fds']))} | {', '.join(map(str, h['sockets']))} |")
    e = result["exchanges"]
    print(f"exchanges outside fault windows: {e['ok']} ok, {e['failed']} failed "
          f"(success {e['success_rate']:.1%}); {e['cancelled_half_formed']} half-formed pairs "
          f"cancelled; {e['excluded_in_fault_windows']} inside windows")
    print("rounds with a partner: " + ", ".join(
        f"{key} {p['with_partner']}/{p['rounds']} (caught up {p['caught_up']}x)"
        for key, p in result["pairing"].items()))
    print("honest contributions refused (noise check): " + ", ".join(
        f"{key} {p['contributions_refused']} ({p['refused_as_noise']})"
        for key, p in result["pairing"].items()))


if __name__ == "__main__":
    main()
