"""Time to loss on shaped links where communication rivals compute, and the trainers' idle time
(issues 7 and 20).

    sudo .venv/bin/python benchmarks/time_to_loss.py --inner-steps 10 --steps 160 --rate 9mbit
    sudo .venv/bin/python benchmarks/time_to_loss.py ... --rates 3=2mbit     # one node 4x slower
    sudo .venv/bin/python benchmarks/time_to_loss.py ... --resume   # after an interruption: the rest

The volunteer regime (docs/protocols.md §4) is set by the ratio of one fp32 ring
all-reduce (2 (N-1)/N x 4 bytes a parameter from each node) to one round's compute (H inner
steps): `--rate` and `--inner-steps` choose it on this machine, and the report prints it twice,
as predicted (the all-reduce's bytes over the link rate, against the local-only run's measured
round time) and as measured (DiLoCo over hivemind's wait in fp32, against the same round time).

Every method trains the same `tiny` model on the same embedded corpus with the daemon's own
inner trainer, each node in its own network namespace behind a shaped access link
(benchmarks/netns.py), one method after another:
- NoLoCo (overlap, θ in int8, pairing paced to the link) and DiLoCoX (low-rank rank 4 at 4 bits,
  the outer step as messages arrive, μ = 0.6, the adaptive controller on): `lowcomm-node join`
  daemons, their p2pd behind the node's delaying relay (`--announce` names the relay);
- DiLoCo over hivemind's DecentralizedAverager, fp32 and fp16 on the wire, through the same
  relays (η = 0.7, Nesterov μ = 0.6: its best in the convergence grids);
- synchronous data-parallel (gloo all-reduce of the gradients every step). gloo opens its own
  connections on ports it picks, so no relay can sit in front of them: its traffic crosses the
  shaped links with no added latency, a lower bound on its time (it favours the baseline);
- local-only: each node trains alone (no network).
`--step-seconds` emulates an accelerator: every method's inner step is padded to that wall time
(the daemon's train.min_step_seconds, and the same padding in baseline_trainer.py). Without it 4
nodes share 2 cores, and a daemon's network work (p2pd, codecs, hashing) takes compute time
that local-only spends on training, which a node with its own GPU would not pay; with it, a
step costs every method the same time as long as the cores have spare time left.
The budget is the same number of inner steps per node for every method (data-parallel gets a
wall-clock cap instead, see --dp-minutes), unless --steps-for gives a method its own: a method
faster per step then gets about the wall clock a slower one takes, which is the budget a
volunteer has (each method's learning-rate schedule spans its own steps). Each method's time to
a loss is the wall clock from its start until the mean of its nodes' validation losses at one
evaluation step first reaches it; the report gives every method's time to every method's final
loss. Bytes are what each node's interface sent (tx counters of its veth), and idle is the time
a trainer waited on the network over its wall clock.
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
from benchmarks.netns import ShapedSwarm, rate_bits  # noqa: E402
from node.config.manifest import Manifest, write_manifest  # noqa: E402
from node.config.schema import parse_override  # noqa: E402
from p2p.host import dead_sockets_removed  # noqa: E402

PYTHON = sys.executable
P2P_PORT, RELAY_PORT, DP_PORT = 4100, 4101, 29500
METHODS = ("noloco", "dilocox", "diloco-hivemind", "diloco-hivemind-fp16", "data-parallel", "local")
BASELINES = {"diloco-hivemind": ("diloco-hivemind", ["--wire", "fp32"]),
             "diloco-hivemind-fp16": ("diloco-hivemind", ["--wire", "fp16"]),
             "data-parallel": ("data-parallel", []), "local": ("local", [])}


def tiny_manifest(protocol: str, steps: int, eval_every: int, threads: int,
                  inner_steps: int = 50) -> Manifest:
    m = Manifest()
    m.swarm.id = f"ttl-{protocol}"
    m.protocol.name = "dilocox" if protocol == "dilocox" else "noloco"
    m.protocol.inner_steps = inner_steps  # 50: a round takes ~45 s of compute here
    t = m.train
    t.steps, t.decay_steps, t.eval_every, t.checkpoint_every, t.threads = steps, steps, eval_every, 0, threads
    return m


def method_manifest(method: str, args: argparse.Namespace) -> Manifest:
    """Each method at its best settings in the simulated grids (benchmarks/NOTEBOOK.md "What
    DiLoCoX's gap to DiLoCo is made of" and the NoLoCo grid); NoLoCo at the manifest defaults,
    which its tuned step (α 0.6, β = γ 1.1) did not beat."""
    m = tiny_manifest(method, method_steps(method, args), args.eval_every or args.inner_steps,
                      args.threads, args.inner_steps)
    m.train.min_step_seconds = args.step_seconds
    p = m.protocol
    if method.startswith("diloco-hivemind"):
        p.outer_lr, p.outer_momentum = 0.7, 0.6
    elif method == "dilocox":
        p.codec, p.rank, p.bits, p.apply_on_arrival, p.outer_momentum = "lowrank", 4, 4, True, 0.6
        p.controller = True  # the compression adapts to the link (issue 18)
    for key, value in (args.protocol_set.get(method) or {}).items():  # --set METHOD.KEY=VALUE
        setattr(p, key, value)
    return m


def method_steps(method: str, args: argparse.Namespace) -> int:
    """The method's inner steps (and the length of its learning-rate schedule): --steps, or its
    own from --steps-for, so that a method faster per step can be given the wall clock a slower
    one takes (time to a loss at an equal wall-clock budget, not an equal step budget)."""
    return args.steps_for.get(method, args.steps)


def parse_steps_for(text: str) -> dict[str, int]:
    """--steps-for "noloco=320,dilocox=320"."""
    try:
        steps = {k: int(v) for k, v in (item.split("=", 1) for item in text.split(",") if item)}
    except ValueError:
        raise SystemExit(f"--steps-for {text!r}: each item must be METHOD=STEPS, e.g. noloco=320") from None
    if unknown := set(steps) - set(METHODS):
        raise SystemExit(f"--steps-for: no method {sorted(unknown)}; the methods are {', '.join(METHODS)}")
    return steps


def parse_sets(items: list[str]) -> dict[str, dict]:
    """--set noloco.max_swap_rounds=1: a protocol setting of one method (values as the daemon's
    --set reads them, node/config/schema.py parse_override)."""
    sets: dict[str, dict] = {}
    for item in items:
        key, value = parse_override(item)
        method, dot, name = key.partition(".")
        if not dot:
            raise SystemExit(f"--set {item!r}: write METHOD.KEY=VALUE, e.g. noloco.max_swap_rounds=1")
        sets.setdefault(method, {})[name] = value
    return sets


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
        runs.append({"evals": evals, "wait": sum(waits), "rounds": len(waits),
                     "start": next(e["time"] for e in events if e["event"] == "joined"),
                     "end": next(e["time"] for e in reversed(events) if e["event"] in ("trained", "left"))})
    return runs


def run_baseline(swarm: ShapedSwarm, base: Path, manifest: Manifest, method: str, steps: int,
                 eval_every: int, timeout: float, hivemind_options: list[str] = ()) -> list[list[dict]]:
    path = write_manifest(manifest, base / "manifest.toml")
    processes, first_address = [], None
    trainer, options = BASELINES[method]
    for i in range(swarm.n):
        out = base / f"node-{i}.jsonl"
        command = [PYTHON, str(REPO / "benchmarks" / "baseline_trainer.py"), trainer, "--manifest", str(path),
                   "--out", str(out), "--steps", str(steps), "--eval-every", str(eval_every), *options]
        if trainer == "local":
            command += ["--node-index", str(i)]
        elif trainer == "diloco-hivemind":
            swarm.relay(i, RELAY_PORT, ("127.0.0.1", P2P_PORT))
            command += ["--node-index", str(i), "--group-size", str(swarm.n), *hivemind_options,
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
        if i == 0 and trainer == "diloco-hivemind":
            first_address = wait_for_file(out.with_suffix(".address"), processes, 120)
    try:
        wait_all(processes, timeout=timeout)
    except subprocess.TimeoutExpired:  # a wall-clock cap (--dp-minutes, --max-minutes): what it reached so far
        for process in processes:
            process.terminate()
        wait_all(processes, timeout=60)
    runs = []
    for i in range(swarm.n):
        events = read_events(base / f"node-{i}.jsonl")
        runs.append({"evals": [e for e in events if e["event"] == "eval"],
                     "wait": sum(e["network_wait_seconds"] for e in events if e["event"] == "sync"),
                     "rounds": max((e.get("step", 0) for e in events), default=0) // manifest.protocol.inner_steps,
                     "start": events[0]["time"] if events else time.time(),
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


def parse_rates(text: str) -> dict[int, str]:
    """--rates "3=2mbit,1=5mbit": nodes whose access link differs from --rate."""
    try:
        return {int(k): v for k, v in (item.split("=", 1) for item in text.split(",") if item)}
    except ValueError:
        raise SystemExit(f"--rates {text!r}: each item must be NODE=RATE, e.g. 3=2mbit") from None


def regime(results: dict[str, dict], args: argparse.Namespace) -> dict:
    """The ratio of one fp32 ring all-reduce to one round's compute, predicted from the bytes and
    the link rate and measured from DiLoCo over hivemind's wait, both against the local-only
    run's round time (compute and evaluation, no network)."""
    from node.train.model import build_model
    parameters = sum(p.numel() for p in build_model(tiny_manifest("noloco", 1, 0, 1).model, 256).parameters())
    ring_bytes = 2 * (args.nodes - 1) / args.nodes * 4 * parameters
    out = {"parameters": parameters, "ring_bytes_per_node": ring_bytes,
           "ring_seconds_predicted": ring_bytes * 8 / rate_bits(args.rate)}
    local = results.get("local", {}).get("curve") or []
    if len(local) >= 2:
        (t0, s0, _), (t1, s1, _) = local[0], local[-1]
        out["round_compute_seconds"] = (t1 - t0) / (s1 - s0) * args.inner_steps
        out["ratio_predicted"] = out["ring_seconds_predicted"] / out["round_compute_seconds"]
        diloco = results.get("diloco-hivemind")
        if diloco and diloco.get("wait_per_round"):
            out["ring_seconds_measured"] = statistics.fmean(diloco["wait_per_round"])
            out["ratio_measured"] = out["ring_seconds_measured"] / out["round_compute_seconds"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rate", default="20mbit")
    parser.add_argument("--rates", default="", help="nodes on another link, e.g. 3=2mbit")
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--inner-steps", type=int, default=50, help="H, for every method")
    parser.add_argument("--steps", type=int, default=400, help="inner steps per node (default 400)")
    parser.add_argument("--steps-for", default="",
                        help="other step budgets of some methods, e.g. noloco=320,dilocox=320")
    parser.add_argument("--eval-every", type=int, default=0, help="default: every round (H)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="the emulated accelerator: every method's inner step padded to this "
                             "wall time (train.min_step_seconds), so that the shared cores' spare "
                             "time, not the training's, carries the network work")
    parser.add_argument("--dp-minutes", type=float, default=0.0,
                        help="data-parallel's wall-clock cap (default: twice the slowest other method)")
    parser.add_argument("--max-minutes", type=float, default=60.0,
                        help="wall-clock cap of the other baselines (a hivemind group that hangs): "
                             "what they reached by then is kept")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--hivemind", default="",
                        help="options of baseline_trainer.py's DiLoCo over hivemind, e.g. "
                             "'--request-timeout 10 --matchmaking-time 15' on a slow link")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE",
                        help="a protocol setting of one method, e.g. noloco.wire_dtype=int4")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "time_to_loss.json")
    parser.add_argument("--work-dir", type=Path, help="keep the nodes' logs here (default: a temporary directory)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the methods already in --out (each is saved as it ends), run the rest")
    parser.add_argument("--report-only", action="store_true",
                        help="print the tables and redraw the plot of --out (same arguments as its run)")
    args = parser.parse_args()
    methods, rates = args.methods.split(","), parse_rates(args.rates)
    args.protocol_set, args.steps_for = parse_sets(args.set), parse_steps_for(args.steps_for)
    eval_every = args.eval_every or args.inner_steps
    results: dict[str, dict] = {}
    if args.report_only:
        return report(json.loads(args.out.read_text())["results"], args)
    if args.resume and args.out.exists():
        results = {m: r for m, r in json.loads(args.out.read_text())["results"].items() if m in methods}
    with tempfile.TemporaryDirectory(prefix="lowcomm-ttl-") as tmp:
        tmp = args.work_dir or tmp
        for method in [m for m in methods if m not in results]:
            base = Path(tmp) / method
            base.mkdir(parents=True, exist_ok=args.resume)
            manifest, steps = method_manifest(method, args), method_steps(method, args)
            # hivemind's DHT (DiLoCo's baseline) leaves its client sockets behind: removed once dead
            with dead_sockets_removed(), \
                    ShapedSwarm(n=args.nodes, rate=args.rate, delay_ms=args.delay_ms, rates=rates) as swarm:
                load_before, started = os.getloadavg()[0], time.time()
                if method in ("noloco", "dilocox"):
                    runs = run_daemons(swarm, base, manifest, steps)
                else:
                    longest = max((r["wall"] for r in results.values()), default=600.0)
                    cap = args.dp_minutes * 60 or 2 * longest
                    runs = run_baseline(swarm, base, manifest, method, steps, eval_every,
                                        timeout=cap if method == "data-parallel" else args.max_minutes * 60,
                                        hivemind_options=args.hivemind.split())
                wall = time.time() - started
                sent = [swarm.tx_bytes(i) for i in range(swarm.n)]
            results[method] = {
                "wall": wall, "curve": mean_curve(runs, started),
                "sent_bytes_per_node": statistics.fmean(sent), "sent_bytes": sent,
                # over the rounds it ran: a run stopped at its cap ran fewer than planned
                "wait_per_round": [r["wait"] / max(1, r["rounds"]) for r in runs],
                "idle_fraction": [r["wait"] / max(r["end"] - r["start"], 1e-9) for r in runs],
                # a node's rounds (H steps) over its own training time: the pace a slow node may cost others
                "rounds_per_minute": [60 * r["rounds"] / max(r["end"] - r["start"], 1e-9) for r in runs],
                "load_average": [load_before, os.getloadavg()[0]]}
            print(f"{method}: {wall / 60:.1f} min, final {results[method]['curve'][-1] if results[method]['curve'] else None}",
                  flush=True)
            args.out.write_text(json.dumps({"target": None, "partial": True, "results": results}, indent=1))
    report(results, args)


def plot(results: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, r in results.items():
        if r["curve"]:
            axes[0].plot([t / 60 for t, _, _ in r["curve"]], [v for _, _, v in r["curve"]], "o-",
                         markersize=3, label=method)
        axes[1].bar(method, 100 * statistics.fmean(r["idle_fraction"]))
    axes[0].set(xlabel="wall-clock (min)", ylabel="mean validation loss of the nodes", title=title)
    axes[0].legend()
    axes[1].set(ylabel="% of wall-clock the trainer waits on the network", title="idle time (mean of nodes)")
    axes[1].tick_params(axis="x", labelrotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    """Every method's time to every method's final loss, the whole runs, and the regime."""
    finals = {m: r["curve"][-1][2] for m, r in results.items() if r["curve"]}
    for result in results.values():
        result["time_to_final_of"] = {m: time_to(result["curve"], loss) for m, loss in finals.items()}
    measured = regime(results, args)
    args.out.write_text(json.dumps({"regime": measured, "args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=1))
    ratio = measured.get("ratio_measured", measured.get("ratio_predicted"))
    title = (f"{args.nodes} nodes, tiny model, H = {args.inner_steps}, {args.rate}"
             + (f", {args.step_seconds:g} s a step" if args.step_seconds else "")
             + (f" ({args.rates})" if args.rates else "") + (f", ratio {ratio:.1f}" if ratio else ""))
    plot(results, title, args.out.with_suffix(".png"))
    print("regime:", json.dumps(measured))
    print("| method | whole run | final val loss (step) | sent per node | idle fraction (per node) "
          "| rounds a minute (per node) |")
    print("|---|---|---|---|---|---|")
    for method, r in results.items():
        final = f"{r['curve'][-1][2]:.4f} ({r['curve'][-1][1]})" if r["curve"] else "-"
        idle = ", ".join(f"{x:.1%}" for x in r["idle_fraction"])
        pace = ", ".join(f"{x:.2f}" for x in r.get("rounds_per_minute", [])) or "-"
        print(f"| {method} | {r['wall'] / 60:.2f} min | {final} | {r['sent_bytes_per_node'] / 2**20:.1f} MiB "
              f"| {idle} | {pace} |")
    print("\ntime to each method's final loss (rows: the loss; columns: the method reaching it)")
    print("| loss | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for target, loss in sorted(finals.items(), key=lambda kv: kv[1]):
        cells = [(f"{hit[0] / 60:.2f} min (step {hit[1]})"
                  if (hit := results[m]["time_to_final_of"][target]) else "not reached")
                 for m in results]
        print(f"| {loss:.4f} ({target}'s final) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
