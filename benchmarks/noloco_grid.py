"""NoLoCo's payload beyond one tuned setting (issue 19): N ∈ {4, 8} × H ∈ {25, 50}.

Every cell runs, on the convergence table's budget (800 inner steps of 3×64 tokens per
replica, inner lr 1e-3, the tiny model): NoLoCo as it was (φ and Δ in bf16), NoLoCo's new payload
(θ alone, quantized), DiLoCo at H with outer momentum μ ∈ {0.3, 0.6, 0.9} (its best is the
reference), and local-only (one run per N: local training does not depend on H). The cell
N = 8, H = 25 (32 rounds) runs two seeds. Jobs run in parallel processes (benchmarks/grid_jobs.py),
each in its own JSON file in benchmarks/grid_runs/.

    .venv/bin/python benchmarks/noloco_grid.py              # the grid, 2 processes
    .venv/bin/python benchmarks/noloco_grid.py --report     # the table from finished jobs

Writes benchmarks/noloco_grid.json and its block of benchmarks/NOTEBOOK.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from grid_jobs import STEPS, Job, load_finished, per_round_bytes, publish, run_jobs  # noqa: E402
from node.simulator.report import human_bytes  # noqa: E402

CELLS = [(8, 25), (8, 50), (4, 25), (4, 50)]
DILOCO_MOMENTA = (0.3, 0.6, 0.9)
# NoLoCo's own outer settings tried where DiLoCo's best beat its defaults most (N = 8, H = 25):
# "a<α>-g<β = γ>", both within the pair's stability condition α < γ < √(2 + α²)
NOLOCO_TUNING = ("a0.6-g0.7", "a0.6-g0.9", "a0.6-g1.1")
TWO_SEED_CELL = (8, 25)
# θ's rounding on the wire, the daemon's code (protocol.wire_rounding), in that cell: method,
# seeds. int4 to nearest pulled a θ that barely moves to the same code every round
# (benchmarks/noloco_groups.py's experiment); stochastic rounding is unbiased.
ROUNDING = (("noloco-new-wint4", (0,)), ("noloco-new-wint4-sr", (0, 1)), ("noloco-new-sr", (0,)))
# and in the other cells, seed 0: int4 rounded stochastically, the candidate default
ROUNDING_ELSEWHERE = (("noloco-new-wint4-sr", (0,)),)


def rounding_methods(workers: int, h: int) -> tuple:
    return ROUNDING if (workers, h) == TWO_SEED_CELL else ROUNDING_ELSEWHERE


def all_jobs() -> list[Job]:
    jobs = []
    for seed in (0, 1):
        for workers, h in CELLS:
            if seed == 1 and (workers, h) != TWO_SEED_CELL:
                continue
            # μ = 0.3 (the NoLoCo paper's DiLoCo baseline) ran first, in the first cell only: it
            # ended 5.6% above μ = 0.6 there, so the other cells try 0.6 and 0.9
            momenta = DILOCO_MOMENTA if (workers, h, seed) == (*TWO_SEED_CELL, 0) else DILOCO_MOMENTA[1:]
            methods = ["noloco-new", "noloco-old", *(f"diloco-{m}" for m in momenta)]
            if (workers, h, seed) == (*TWO_SEED_CELL, 0):
                methods += [f"noloco-new-{t}" for t in NOLOCO_TUNING]
            methods += [m for m, seeds in rounding_methods(workers, h) if seed in seeds]
            jobs += [Job(workers, h, m, seed) for m in methods]
            if seed == 1 or h == 50:
                # once per N and seed, keyed H = 50: local-only does not depend on H
                jobs.append(Job(workers, 50, "local", seed))
    # the longest first, so that two processes end together
    return sorted(jobs, key=lambda j: (-j.workers, j.seed))


def report(finished: dict[str, dict], command: str) -> tuple[str, dict]:
    """The table of the grid, and its JSON summary."""
    def loss(workers, h, method, seed=0):
        run = finished.get(Job(workers, h, method, seed).key)
        return None if run is None else run["final_val_loss"]

    rows, summary = [], {}
    for workers, h in CELLS:
        seeds = (0, 1) if (workers, h) == TWO_SEED_CELL else (0,)

        def mean(method, h_=h):
            values = [loss(workers, h_, method, s) for s in seeds]
            return None if None in values else statistics.fmean(values)
        diloco = {m: mean(f"diloco-{m}") for m in DILOCO_MOMENTA}
        diloco = {m: loss for m, loss in diloco.items() if loss is not None}
        if not diloco:
            continue
        best_mu = min(diloco, key=diloco.get)
        local = mean("local", 50)
        new, old = mean("noloco-new"), mean("noloco-old")
        if None in (local, new, old):
            continue
        diloco_run = finished[Job(workers, h, f"diloco-{best_mu}", 0).key]
        new_run = finished[Job(workers, h, "noloco-new", 0).key]
        old_run = finished[Job(workers, h, "noloco-old", 0).key]
        cell = {"workers": workers, "inner_steps": h, "rounds": STEPS // h, "seeds": list(seeds),
                "diloco_by_momentum": diloco, "diloco_best_momentum": best_mu,
                "diloco": diloco[best_mu], "local": local, "noloco_new": new, "noloco_old": old,
                "bytes_per_round": {"diloco_fp32_ring": per_round_bytes(diloco_run),
                                    "noloco_new": per_round_bytes(new_run),
                                    "noloco_old": per_round_bytes(old_run)}}
        summary[f"N{workers}-H{h}"] = cell

        def pct(a, b):
            return f"{100 * (a / b - 1):+.2f}%"
        b = cell["bytes_per_round"]
        rows.append(
            f"| {workers} | {h} | {STEPS // h} | {len(seeds)} | "
            + " / ".join(f"{diloco[m]:.4f}" if m in diloco else "-" for m in DILOCO_MOMENTA)
            + f" (μ = {best_mu}) | "
            f"{old:.4f} | {new:.4f} | {local:.4f} | {pct(new, old)} | {pct(new, diloco[best_mu])} | "
            f"{pct(old, diloco[best_mu])} | {pct(new, local)} | "
            f"{human_bytes(b['noloco_new'])} ({b['diloco_fp32_ring'] / b['noloco_new']:.1f}x) |")
    header = ("| N | H | rounds | seeds | DiLoCo μ = " + " / ".join(map(str, DILOCO_MOMENTA))
              + " (best) | NoLoCo φ,Δ bf16 | NoLoCo θ int8 | local | θ int8 vs φ,Δ | θ int8 vs DiLoCo"
              " | φ,Δ vs DiLoCo | θ int8 vs local | θ int8 per round (DiLoCo's / these) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    tuning = [(t, finished.get(Job(*TWO_SEED_CELL, f"noloco-new-{t}", 0).key)) for t in NOLOCO_TUNING]
    tuned = "\n".join(f"| {t.split('-')[0][1:]} | {t.split('-')[1][1:]} | {run['final_val_loss']:.4f} |"
                      for t, run in tuning if run is not None)
    default = finished.get(Job(*TWO_SEED_CELL, "noloco-new", 0).key)
    if tuned and default:
        tuned = ("\n\nNoLoCo's own outer settings at N = 8, H = 25, seed 0 (θ int8; the default is "
                 "α = 0.5, β = γ = 0.7):\n\n| α | β = γ | final val loss |\n|---|---|---|\n"
                 f"| 0.5 | 0.7 | {default['final_val_loss']:.4f} |\n" + tuned)
    rounding, summary["rounding"] = rounding_table(finished, summary)
    text = ("### NoLoCo against DiLoCo and local-only: N × H (issue 19)\n\n"
            f"{STEPS} inner steps of 3×64 tokens per replica in every cell (the convergence table's "
            "budget), tiny model, inner lr 1e-3; NoLoCo overlap, α = 0.5, β = γ = 0.7; DiLoCo η = 0.7, "
            "Nesterov, at each μ listed (the best is the reference); final validation loss, the mean "
            "over replicas (and over seeds where 2). Bytes per node per round: NoLoCo's encoded "
            "snapshot, DiLoCo's fp32 ring all-reduce.\n\n"
            + header + "\n" + "\n".join(rows) + tuned + rounding
            + "\n\nCommand:\n\n    " + command + "\n")
    return text, summary


def rounding_table(finished: dict[str, dict], cells: dict) -> tuple[str, dict]:
    """θ's wire dtype and rounding in each cell, against θ int8 to nearest ("noloco-new", over
    the cell's seeds) and DiLoCo at its best μ; each seed, and its bytes a round."""
    rows, summary = [], {}
    for workers, h in CELLS:
        cell = cells.get(f"N{workers}-H{h}")
        if cell is None:
            continue
        seeds_of_default = tuple(cell["seeds"])
        methods = (("noloco-new", seeds_of_default), *rounding_methods(workers, h))
        for method, seeds in methods:
            runs = [finished.get(Job(workers, h, method, s).key) for s in seeds]
            if None in runs:
                continue
            dtype = "int4" if "wint4" in method else "int8"
            how = "stochastic" if method.endswith("-sr") else "nearest"
            losses = [r["final_val_loss"] for r in runs]
            mean = statistics.fmean(losses)
            ring, sent = cell["bytes_per_round"]["diloco_fp32_ring"], per_round_bytes(runs[0])
            summary[f"N{workers}-H{h}-{method}"] = {
                "wire_dtype": dtype, "rounding": how, "seeds": list(seeds),
                "final_val_loss": losses, "bytes_per_round": sent}
            rows.append(f"| {workers} | {h} | {dtype} | {how} | " + " / ".join(f"{v:.4f}" for v in losses)
                        + f" | {100 * (mean / cell['noloco_new'] - 1):+.2f}% | "
                        f"{100 * (mean / cell['noloco_old'] - 1):+.2f}% | "
                        f"{100 * (mean / cell['diloco'] - 1):+.2f}% | {100 * (mean / cell['local'] - 1):+.2f}% | "
                        f"{human_bytes(sent)} ({ring / sent:.1f}x) |")
    if not any("stochastic" in row for row in rows):
        return "", summary
    return ("\n\nθ's rounding on the wire (the daemon's NoLoCoRound, `protocol.wire_rounding`; "
            "α = 0.5, β = γ = 0.7; a row's mean over the seeds it lists, against the cell's θ int8 "
            "and φ,Δ bf16 over the cell's seeds):\n\n"
            "| N | H | θ on the wire | rounding | final val loss by seed | vs θ int8 nearest | vs φ,Δ bf16 "
            "| vs DiLoCo (best μ) | vs local | per round (DiLoCo's / these) |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)), summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only the table, from finished jobs")
    p.add_argument("--jobs-dir", type=Path, default=HERE / "grid_runs")
    p.add_argument("--no-results", action="store_true")
    args = p.parse_args(argv)
    if not args.report:
        run_jobs(all_jobs(), args.jobs_dir, args.processes)
    text, summary = report(load_finished(args.jobs_dir), ".venv/bin/python benchmarks/noloco_grid.py")
    publish("noloco_grid", text, summary, not args.no_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
