"""DiLoCoX at 32 and 64 replicas with a committee of senders (issue 18, "Scale").

Each swarm size runs DiLoCoX whose members send in a round only when drawn for its committee
(protocol/committee.py: about `--senders` a round, each serving `--tenure` rounds in a row;
the others' rounds are not sent unless `--kept-decay` > 0), on the convergence table's model
and budget per step (tiny, 3×64 tokens, inner lr 1e-3), with the N x H grid's best settings
(apply on arrival, a step's latency, μ = 0.6, median clipping), the eager overlap and
`--power-iterations` (the committee's and the encoder's defaults are the manifest's); and
local-only training on `--local-workers` replicas of the same budget (each trains alone, so
its loss does not depend on the swarm's size). Reported per size: the final validation loss,
DiLoCoX's bytes sent per node per round (every encoded message to the N − 1 others and the φ
digests, as the simulator counts them) against an fp32 ring all-reduce of the model, and the
rounds whose φ was not the same on every replica. Each run is written to grid_runs/ as it ends
(a rerun takes what is there); the table goes to benchmarks/dilocox_scale.json and its block of
NOTEBOOK.md.

    .venv/bin/python benchmarks/dilocox_scale.py                   # N = 32 and 64, both methods
    .venv/bin/python benchmarks/dilocox_scale.py --workers 32 --rounds 3 --no-results  # a pilot
    .venv/bin/python benchmarks/dilocox_scale.py --workers 32 --codec identity --kept-decay 1 \
        --set model.dim=64 ...    # the committee alone, on another model (runs kept apart)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from convergence import node_config as convergence_config, parse_args as convergence_args, \
    write_block  # noqa: E402
from node.config.manifest import ProtocolSection  # noqa: E402
from node.data.corpus import load_corpus  # noqa: E402
from node.simulator import SimulationSettings, run_simulation  # noqa: E402
from node.simulator.exchange import ring_allreduce_bytes  # noqa: E402
from node.simulator.report import markdown_table  # noqa: E402

MANIFEST = ProtocolSection()  # the committee's and the encoder's defaults are the manifest's


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="32,64", help="comma-separated swarm sizes (default 32,64)")
    p.add_argument("--inner-steps", type=int, default=25, help="H (default 25)")
    p.add_argument("--rounds", type=int, default=24, help="outer rounds (default 24)")
    p.add_argument("--senders", type=int, default=MANIFEST.senders, help="committee: senders a "
                   f"round (default {MANIFEST.senders}, the manifest's)")
    p.add_argument("--tenure", type=int, default=MANIFEST.senders_tenure, help="committee: rounds "
                   f"in a row a member drawn sends (default {MANIFEST.senders_tenure}, the "
                   "manifest's)")
    p.add_argument("--codec", default="lowrank", choices=("lowrank", "identity"),
                   help="DiLoCoX codec (default lowrank; identity: the committee alone)")
    p.add_argument("--rank", type=int, default=4, help="low-rank rank (default 4)")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8), help="bits (default 4)")
    p.add_argument("--power-iterations", type=int, default=MANIFEST.power_iterations,
                   help="low-rank power iterations an encode takes (default "
                   f"{MANIFEST.power_iterations}, the manifest's)")
    p.add_argument("--kept-decay", help="β_k, what a round sat out still weighs in the next "
                   "message: comma-separated values, one DiLoCoX run each (default: the "
                   "manifest's, 0)")
    p.add_argument("--micro-batch", type=int, default=3, help="sequences of 64 tokens a step "
                   "(default 3)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a node-config override, e.g. model.dim=64 (repeatable)")
    p.add_argument("--outer-momentum", type=float, default=0.6, help="μ (default 0.6, the N x H "
                   "grid's best for DiLoCo and DiLoCoX)")
    p.add_argument("--lr", type=float, default=1e-3, help="inner peak lr (default 1e-3, the "
                   "convergence table's)")
    p.add_argument("--local-workers", type=int, default=8, help="replicas of the local-only "
                   "reference (default 8: each trains alone, so its loss does not depend on the "
                   "swarm's size)")
    p.add_argument("--diloco", action="store_true", help="also DiLoCo (every replica's fp32 Δ "
                   "every round, μ = --outer-momentum) at each size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--only", help="comma-separated run keys (pilots)")
    p.add_argument("--out", type=Path, default=HERE / "dilocox_scale.json")
    p.add_argument("--runs-dir", type=Path, default=HERE / "grid_runs")
    p.add_argument("--results", type=Path, default=HERE / "NOTEBOOK.md")
    p.add_argument("--no-results", action="store_true", help="touch neither NOTEBOOK.md nor --out")
    args = p.parse_args(argv)
    args.workers = [int(n) for n in args.workers.split(",")]
    args.kept_decays = [float(v) for v in args.kept_decay.split(",")] if args.kept_decay else [None]
    # runs on another model or budget are kept apart from the default one's
    args.tag = "-" + "-".join(o.split("=")[0].split(".")[-1] + o.split("=")[1].strip('"')
                              for o in args.overrides) if args.overrides else ""
    if (args.micro_batch, args.lr, args.inner_steps, args.rounds) != (3, 1e-3, 25, 24):
        args.tag += f"-mb{args.micro_batch}-lr{args.lr:g}-H{args.inner_steps}-R{args.rounds}"
    return args


def node_config(args: argparse.Namespace):
    """The convergence table's node config (the tiny model, 64-token sequences, its warm-up and
    evaluation), with this run's sequences a step, lr and overrides."""
    return convergence_config(convergence_args(
        ["--micro-batch", str(args.micro_batch), "--lr", str(args.lr),
         *(arg for override in args.overrides for arg in ("--set", override))]))


def runs(args: argparse.Namespace) -> dict[str, SimulationSettings]:
    """The runs, by key: for each size, DiLoCoX with its committee and local-only."""
    common = {"seed": args.seed, "inner_steps": args.inner_steps, "rounds": args.rounds,
              "eval_every": args.rounds}
    out = {f"scale{args.tag}-N{args.local_workers}-local-s{args.seed}":
           SimulationSettings("local", workers=args.local_workers, **common)}
    for n in args.workers:
        common["workers"] = n
        if args.diloco:
            out[f"scale{args.tag}-N{n}-diloco-{args.outer_momentum:g}-s{args.seed}"] = \
                SimulationSettings("diloco", outer_momentum=args.outer_momentum, **common)
        # the N x H grid's best candidate (apply on arrival, a step's latency, μ = 0.6) with
        # median clipping, as the manifest ships it, the eager overlap and the committee (its
        # members send their fresh round alone: kept_decay = 0, the manifest's)
        codec = {"codec": "lowrank", "rank": args.rank, "bits": args.bits} \
            if args.codec == "lowrank" else {"codec": args.codec}
        for kept_decay in args.kept_decays:
            values = {"apply_on_arrival": True, "clip_to_median": True, "overlap": "eager",
                      "senders": args.senders, "senders_tenure": args.tenure}
            name = f"lr{args.rank}b{args.bits}" if args.codec == "lowrank" else args.codec
            if args.codec == "lowrank":
                values["power_iterations"] = args.power_iterations
                name += f"-i{args.power_iterations}" if args.power_iterations != 1 else ""
            if kept_decay is not None:
                values["kept_decay"] = kept_decay
                name += f"-kd{kept_decay:g}"
            tenure = f"t{args.tenure}" if args.tenure != 1 else ""
            out[f"scale{args.tag}-N{n}-dilocox-k{args.senders}{tenure}-{name}-s{args.seed}"] = \
                SimulationSettings("dilocox", **codec, outer_momentum=args.outer_momentum,
                                   latency_steps=1, protocol_values=values, **common)
    # the longest first: two at a time, the 64 replicas' run sets the wall time
    out = dict(sorted(out.items(), key=lambda item: -item[1].workers))
    if args.only:
        out = {k: v for k, v in out.items() if k in args.only.split(",")}
    return out


def run_one(key: str, settings: SimulationSettings, args: argparse.Namespace) -> dict:
    path = args.runs_dir / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    config = node_config(args)
    started = time.perf_counter()
    result = run_simulation(settings, config, load_corpus(config.data))
    data = result.to_dict()
    data["wall_seconds"] = time.perf_counter() - started
    if not args.no_results:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return data


def summary(args: argparse.Namespace, results: dict[str, dict]) -> list[dict]:
    rows = []
    for n in args.workers:
        local = next((r for k, r in results.items() if "-local-" in k), None)
        diloco = next((r for k, r in results.items() if f"-N{n}-diloco-" in k), None)
        for key, run in results.items():
            if f"-N{n}-dilocox" not in key:
                continue
            rounds = run["rounds"]
            last = rounds[-1]
            ring = sum(ring_allreduce_bytes(run["parameters"], 4, n)) / n
            per_round = last["bytes_sent_per_replica"] / last["round"]
            split = [r["round"] for r in rounds if r["phi_digests"] != 1]
            rows.append({
                "N": n, "run": key, "parameters": run["parameters"],
                "final val loss": run["final_val_loss"],
                "local-only": local["final_val_loss"] if local else None,
                "vs local": (run["final_val_loss"] / local["final_val_loss"] - 1) if local else None,
                "DiLoCo": diloco["final_val_loss"] if diloco else None,
                "sent per node per round": per_round, "fp32 ring per node per round": ring,
                "ring / sent": ring / per_round,
                "rounds with more than one φ": split, "resyncs": last["resyncs"],
                # runs written before the wall time was kept have none
                "wall min": run["wall_seconds"] / 60 if "wall_seconds" in run else None})
    return rows


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no DiLoCoX run)"
    return markdown_table([{
        "N": str(r["N"]), "run": r["run"].split("-dilocox-")[1], "final val loss": f"{r['final val loss']:.4f}",
        "local-only": f"{r['local-only']:.4f}" if r["local-only"] else "-",
        "vs local": f"{100 * r['vs local']:+.2f}%" if r["vs local"] is not None else "-",
        "DiLoCo": f"{r['DiLoCo']:.4f}" if r.get("DiLoCo") else "-",
        "sent per node per round": f"{r['sent per node per round'] / 1024:.1f} KiB",
        "fp32 ring / sent": f"{r['ring / sent']:.1f}x",
        "rounds φ differed": str(len(r["rounds with more than one φ"])),
        "resyncs": str(r["resyncs"])}
        for r in rows])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = ".venv/bin/python benchmarks/dilocox_scale.py" + "".join(f" {shlex.quote(a)}" for a in argv)
    todo = runs(args)
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=args.processes) as pool:
        futures = {pool.submit(run_one, key, settings, args): key for key, settings in todo.items()}
        for future in as_completed(futures):
            key = futures[future]
            results[key] = future.result()
            print(f"{key}: final val loss {results[key]['final_val_loss']:.4f}", flush=True)
    rows = summary(args, {k: results[k] for k in todo})
    print(table(rows))
    if not args.no_results:
        # the default runs have their own block and JSON; a variant (another model, codec or
        # kept_decay) writes beside them
        variant = args.tag + ("" if args.codec == "lowrank" else f"-{args.codec}") \
            + ("" if args.kept_decay is None else f"-kd{args.kept_decay.replace(',', '-')}")
        if variant and args.out == HERE / "dilocox_scale.json":
            args.out = HERE / f"dilocox_scale{variant}.json"
        args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n",
                            encoding="utf-8")
        write_block(args.results, f"dilocox-scale{variant}", "\n".join([
            f"### DiLoCoX at {' and '.join(map(str, args.workers))} replicas with a committee of "
            f"about {args.senders} senders a round (issue 18)"
            + (f": {args.codec} code, {variant.lstrip('-')}" if variant else ""),
            "", table(rows), "", "Command:",
            "", f"    {command}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
