"""Time to a target validation loss on shaped links, and the trainers' idle time (issue 7, 2 and 3).

    sudo .venv/bin/python benchmarks/time_to_loss.py            # 4 nodes, 20 Mbit/s, 50 ms one way
    sudo .venv/bin/python benchmarks/time_to_loss.py --resume   # after an interruption: the rest

Four methods train the same `tiny` model on the same embedded corpus, each node in its own network
namespace behind a shaped access link (benchmarks/netns.py), one method after another:
- NoLoCo (overlap) and DiLoCoX (manifest defaults: rank 4, 8-bit, delay 1): `lowcomm-node join`
  daemons, their p2pd behind the node's delaying relay (`--announce` names the relay);
- DiLoCo over hivemind's DecentralizedAverager (fp32), through the same relays;
- synchronous data-parallel (gloo all-reduce of the gradients every step). gloo opens its own
  connections on ports it picks, so no relay can sit in front of them: its traffic crosses the
  shaped links with no added latency, a lower bound on its time (it favours the baseline).
H = 50 for all three (a 4-node tiny run at 100 would have 4 rounds). The budget is the same number of inner steps per node for every method (data-parallel gets a
wall-clock cap instead, see --dp-minutes). The target is the validation loss DiLoCo over
hivemind reaches at the end of its budget (the mean over its nodes); each method's time to the
target is the wall clock from its start until the mean of its nodes' validation losses at one
evaluation step first reaches it. Bytes are what each node's interface sent (tx counters of
its veth), and idle is the time a trainer waited on the network over its wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.netns import ShapedSwarm  # noqa: E402
from node.config.manifest import Manifest, write_manifest  # noqa: E402

PYTHON = sys.executable
P2P_PORT, RELAY_PORT, DP_PORT = 4100, 4101, 29500
METHODS = ("noloco", "dilocox", "diloco-hivemind", "data-parallel")


def tiny_manifest(protocol: str, steps: int, eval_every: int, threads: int) -> Manifest:
    m = Manifest()
    m.swarm.id = f"ttl-{protocol}"
    m.protocol.name = "dilocox" if protocol == "dilocox" else "noloco"
    m.protocol.inner_steps = 50  # every method: a round takes ~45 s of compute here
    t = m.train
    t.steps, t.decay_steps, t.eval_every, t.checkpoint_every, t.threads = steps, steps, eval_every, 0, threads
    return m


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_file(path: Path, processes: list[subprocess.Popen], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a process exited before {path.name} appeared")
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")


def wait_all(processes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.wait(timeout=max(1.0, deadline - time.monotonic()))


# ---------------------------------------------------------------------------- one method's run

def run_daemons(swarm: ShapedSwarm, base: Path, manifest: Manifest, steps: int) -> list[list[dict]]:
    """Our protocol: one `lowcomm-node join` per namespace; p2pd listens on the namespace's
    loopback and peers reach it only through the relay (the delay)."""
    path = write_manifest(manifest, base / "manifest.toml")
    processes, first_address = [], None
    for i in range(swarm.n):
        data_dir = base / f"node-{i}"
        data_dir.mkdir(parents=True)
        swarm.relay(i, RELAY_PORT, ("127.0.0.1", P2P_PORT))
        command = [PYTHON, "-m", "node.cli", "join", "--manifest", str(path), "--data-dir", str(data_dir),
                   "--listen", f"/ip4/127.0.0.1/tcp/{P2P_PORT}",
                   "--announce", f"/ip4/{swarm.address(i)}/tcp/{RELAY_PORT}",
                   "--max-steps", str(steps)]
        command += ["--min-peers", str(swarm.n - 1)] if i == 0 else ["--peer", first_address]
        with open(data_dir / "node.log", "wb") as log:
            processes.append(swarm.popen(i, command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        if i == 0:
            first_address = wait_for_file(data_dir / "address", processes, 120)
    wait_all(processes, timeout=3600)
    runs = []
    for i in range(swarm.n):
        events = read_events(base / f"node-{i}" / "metrics.jsonl")
        evals = [{"time": e["time"], "step": e["step"], "val_loss": e["val_loss"]}
                 for e in events if e["event"] == "round" and "val_loss" in e]
        waits = [e.get("network_wait_seconds", 0.0) for e in events if e["event"] == "round"]
        runs.append({"evals": evals, "wait": sum(waits),
                     "start": next(e["time"] for e in events if e["event"] == "joined"),
                     "end": next(e["time"] for e in reversed(events) if e["event"] in ("trained", "left"))})
    return runs


def run_baseline(swarm: ShapedSwarm, base: Path, manifest: Manifest, method: str, steps: int,
                 eval_every: int, timeout: float) -> list[list[dict]]:
    path = write_manifest(manifest, base / "manifest.toml")
    processes, first_address = [], None
    for i in range(swarm.n):
        out = base / f"node-{i}.jsonl"
        command = [PYTHON, str(REPO / "benchmarks" / "baseline_trainer.py"), method, "--manifest", str(path),
                   "--out", str(out), "--steps", str(steps), "--eval-every", str(eval_every)]
        if method == "diloco-hivemind":
            swarm.relay(i, RELAY_PORT, ("127.0.0.1", P2P_PORT))
            command += ["--node-index", str(i), "--group-size", str(swarm.n),
                        "--listen", f"/ip4/127.0.0.1/tcp/{P2P_PORT}",
                        "--announce", f"/ip4/{swarm.address(i)}/tcp/{RELAY_PORT}"]
            if first_address:
                command += ["--initial-peer", first_address]
        else:
            command += ["--rank", str(i), "--world", str(swarm.n),
                        "--master", f"{swarm.address(0)}:{DP_PORT}"]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}  # gloo's pairs on the shaped link
        with open(base / f"node-{i}.log", "wb") as log:
            processes.append(swarm.popen(i, command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=env))
        if i == 0 and method == "diloco-hivemind":
            first_address = wait_for_file(out.with_suffix(".address"), processes, 120)
    try:
        wait_all(processes, timeout=timeout)
    except subprocess.TimeoutExpired:  # data-parallel's wall-clock cap: what it reached so far
        for process in processes:
            process.terminate()
        wait_all(processes, timeout=60)
    runs = []
    for i in range(swarm.n):
        events = read_events(base / f"node-{i}.jsonl")
        runs.append({"evals": [e for e in events if e["event"] == "eval"],
                     "wait": sum(e["network_wait_seconds"] for e in events if e["event"] == "sync"),
                     "start": events[0]["time"] - 0.0 if events else time.time(),
                     "end": events[-1]["time"] if events else time.time()})
    return runs


# ---------------------------------------------------------------------------- what the runs show

def mean_curve(runs: list[dict], started: float) -> list[tuple[float, int, float]]:
    """(seconds since the method started, step, mean val loss over the nodes that evaluated it),
    a step's time being when its last node reported it."""
    by_step = defaultdict(list)
    for run in runs:
        for e in run["evals"]:
            by_step[e["step"]].append((e["time"], e["val_loss"]))
    return [(max(t for t, _ in values) - started, step, statistics.fmean(v for _, v in values))
            for step, values in sorted(by_step.items()) if len(values) == len(runs)]


def time_to(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    return next(((t, step) for t, step, loss in curve if loss <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rate", default="20mbit")
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=400, help="inner steps per node (default 400)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--dp-minutes", type=float, default=0.0,
                        help="data-parallel's wall-clock cap (default: twice the slowest other method)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "time_to_loss.json")
    parser.add_argument("--work-dir", type=Path, help="keep the nodes' logs here (default: a temporary directory)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the methods already in --out (each is saved as it ends), run the rest")
    args = parser.parse_args()
    methods = args.methods.split(",")
    results: dict[str, dict] = {}
    if args.resume and args.out.exists():
        results = {m: r for m, r in json.loads(args.out.read_text())["results"].items() if m in methods}
    with tempfile.TemporaryDirectory(prefix="lowcomm-ttl-") as tmp:
        tmp = args.work_dir or tmp
        for method in [m for m in methods if m not in results]:
            base = Path(tmp) / method
            base.mkdir(parents=True, exist_ok=args.resume)
            manifest = tiny_manifest(method, args.steps, args.eval_every, args.threads)
            with ShapedSwarm(n=args.nodes, rate=args.rate, delay_ms=args.delay_ms) as swarm:
                load_before, started = os.getloadavg()[0], time.time()
                if method in ("noloco", "dilocox"):
                    runs = run_daemons(swarm, base, manifest, args.steps)
                else:
                    longest = max((r["wall"] for r in results.values()), default=600.0)
                    cap = args.dp_minutes * 60 or 2 * longest
                    runs = run_baseline(swarm, base, manifest, method, args.steps, args.eval_every,
                                        timeout=cap if method == "data-parallel" else 3600)
                wall = time.time() - started
                sent = [swarm.tx_bytes(i) for i in range(swarm.n)]
            results[method] = {
                "wall": wall, "curve": mean_curve(runs, started),
                "sent_bytes_per_node": statistics.fmean(sent),
                "idle_fraction": [r["wait"] / max(r["end"] - r["start"], 1e-9) for r in runs],
                "load_average": [load_before, os.getloadavg()[0]]}
            print(f"{method}: {wall / 60:.1f} min, final {results[method]['curve'][-1] if results[method]['curve'] else None}",
                  flush=True)
            args.out.write_text(json.dumps({"target": None, "partial": True, "results": results}, indent=1))
    report(results, args)


def plot(results: dict[str, dict], target: float | None, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, r in results.items():
        if r["curve"]:
            axes[0].plot([t / 60 for t, _, _ in r["curve"]], [v for _, _, v in r["curve"]], "o-", label=method)
        axes[1].bar(method, 100 * statistics.fmean(r["idle_fraction"]))
    if target is not None:
        axes[0].axhline(target, color="grey", linestyle=":", label="target (DiLoCo-hivemind's final)")
    axes[0].set(xlabel="wall-clock (min)", ylabel="mean validation loss of the nodes",
                title="time to loss, 4 nodes, tiny model")
    axes[0].legend()
    axes[1].set(ylabel="% of wall-clock the trainer waits on the network", title="idle time (mean of nodes)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    reference = results.get("diloco-hivemind")
    target = reference["curve"][-1][2] if reference and reference["curve"] else None
    for result in results.values():
        reached = time_to(result["curve"], target) if target is not None else None
        result["time_to_target"], result["step_at_target"] = reached or (None, None)
        if reached:  # bytes are counted for the whole run: prorate them to the target's time
            result["bytes_to_target"] = result["sent_bytes_per_node"] * reached[0] / result["wall"]
    args.out.write_text(json.dumps({"target": target, "args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=1))
    plot(results, target, args.out.with_suffix(".png"))
    print(f"target: validation loss {target} (DiLoCo over hivemind at the end of its budget)")
    print("| method | time to target | step | bytes sent per node to target | whole run | final val loss | idle fraction (per node) |")
    print("|---|---|---|---|---|---|---|")
    for method, r in results.items():
        ttt = f"{r['time_to_target'] / 60:.2f} min" if r["time_to_target"] is not None else "not reached"
        to_target = f"{r['bytes_to_target'] / 2**20:.1f} MiB" if r.get("bytes_to_target") else "-"
        final = f"{r['curve'][-1][2]:.4f} (step {r['curve'][-1][1]})" if r["curve"] else "-"
        idle = ", ".join(f"{x:.1%}" for x in r["idle_fraction"])
        print(f"| {method} | {ttt} | {r['step_at_target'] or '-'} | {to_target} | {r['wall'] / 60:.2f} min | {final} | {idle} |")


if __name__ == "__main__":
    main()
