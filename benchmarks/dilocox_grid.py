"""DiLoCoX against DiLoCo at its best outer momentum and local-only (issue 18): 8 replicas and
two seeds at H = 25, N ∈ {4, 8} × H ∈ {25, 50}, and its changes one at a time.

Every run is a job of benchmarks/grid_jobs.py on the convergence table's budget (800 inner
steps of 3×64 tokens per replica, tiny model, inner lr 1e-3); the DiLoCo (μ ∈ {0.3, 0.6, 0.9})
and local-only references are the NoLoCo grid's own runs (benchmarks/noloco_grid.py), which
share benchmarks/grid_runs/. Bytes: DiLoCoX's encoded messages to each of the N − 1 others plus
its φ digests (no wire headers), DiLoCo's fp32 ring all-reduce.

    .venv/bin/python benchmarks/dilocox_grid.py --processes 1   # the runs not yet finished
    .venv/bin/python benchmarks/dilocox_grid.py --report        # the tables from finished runs

Writes benchmarks/dilocox_grid.json and its block of benchmarks/NOTEBOOK.md.
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

DILOCO_MOMENTA = (0.3, 0.6, 0.9)
# the candidate: low-rank rank 4 at 4 bits (≥ 50x fewer bytes than the fp32 ring at N = 8,
# where rank 8 is 33x), the outer step taken as the group's messages arrive, a message taking one
# inner step to arrive (≈ 210 KB to 7 peers: 0.1 s at 20 Mbit/s, one step or less on a GPU)
CANDIDATES = ("dilocox-lr4b4-arr-l1", "dilocox-lr4b4-arr-l1-m0.6")
# each change alone, at N = 8, H = 25, seed 0: the codec with no delay, the overlap with the
# identity codec, today's overlap (λ = ½) with the codec
DIAGNOSTICS = ("dilocox-id-arr-l1", "dilocox-lr4b4-d0", "dilocox-lr4b4-l1")
# SparseLoCo's recipe (arXiv 2508.15706: top-k, 2-bit values, no outer momentum, η = 1, a
# decaying error buffer) at the bytes that meet 50x at N = 8: 40 of every 4096
SPARSELOCO = ("dilocox-topk40-arr-l1-m0-e1-r0.95",)
# robust aggregation's honest cost: the candidate with each message clipped to the median
# sender's norm (Templar's rule), both seeds
ROBUST = ("dilocox-lr4b4-arr-l1-m0.6-c",)
# the encoder's compute for bytes: the clipped candidate with 4 power iterations a round,
# both seeds
POWER = ("dilocox-lr4b4-arr-l1-m0.6-c-i4",)
MAIN_CELL = (8, 25)
OTHER_CELLS = [(8, 50), (4, 25), (4, 50)]


def all_jobs(best: str) -> list[Job]:
    """In the order they run: the candidates, the overlap alone, SparseLoCo's recipe, the other
    diagnostics, the second seed of `best`, the median clipping, the other cells, the power
    iterations."""
    jobs = [Job(*MAIN_CELL, m, 0) for m in CANDIDATES + DIAGNOSTICS[:1] + SPARSELOCO + DIAGNOSTICS[1:]]
    jobs.append(Job(*MAIN_CELL, best, 1))
    jobs += [Job(*MAIN_CELL, m, s) for m in ROBUST for s in (0, 1)]
    jobs += [Job(n, h, best, 0) for n, h in OTHER_CELLS]
    jobs += [Job(*MAIN_CELL, m, s) for m in POWER for s in (0, 1)]
    return jobs


def pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.2f}%"


def report(finished: dict[str, dict], command: str) -> tuple[str, dict]:
    def mean_loss(n, h, method, seeds):
        runs = [finished.get(Job(n, h, method, s).key) for s in seeds]
        return None if None in runs else statistics.fmean(r["final_val_loss"] for r in runs)

    rows, summary = [], {}
    methods = list(dict.fromkeys([*CANDIDATES, *DIAGNOSTICS, *SPARSELOCO, *ROBUST, *POWER]))
    for n, h in [MAIN_CELL, *OTHER_CELLS]:
        for method in methods:
            seeds = [s for s in (0, 1) if Job(n, h, method, s).key in finished]
            if not seeds:
                continue
            diloco = {m: mean_loss(n, h, f"diloco-{m}", seeds) for m in DILOCO_MOMENTA}
            diloco = {m: v for m, v in diloco.items() if v is not None}
            local = mean_loss(n, 50, "local", seeds)  # local-only does not depend on H
            if not diloco or local is None:
                continue
            best_mu = min(diloco, key=diloco.get)
            loss = mean_loss(n, h, method, seeds)
            spread = [finished[Job(n, h, method, s).key]["final_val_loss"] for s in seeds]
            sent = per_round_bytes(finished[Job(n, h, method, seeds[0]).key])
            ring = per_round_bytes(finished[Job(n, h, f"diloco-{best_mu}", 0).key])
            summary[f"N{n}-H{h}-{method}"] = {
                "workers": n, "inner_steps": h, "rounds": STEPS // h, "method": method,
                "seeds": seeds, "final_val_loss": loss, "per_seed": spread,
                "diloco": diloco[best_mu], "diloco_best_momentum": best_mu, "local": local,
                "vs_diloco": loss / diloco[best_mu] - 1, "vs_local": loss / local - 1,
                "bytes_per_round": sent, "diloco_fp32_ring_bytes_per_round": ring}
            rows.append(f"| {n} | {h} | `{method}` | {len(seeds)} | {loss:.4f} "
                        f"({' / '.join(f'{v:.4f}' for v in spread)}) | {diloco[best_mu]:.4f} (μ = {best_mu}) "
                        f"| {local:.4f} | {pct(loss, diloco[best_mu])} | {pct(loss, local)} | "
                        f"{human_bytes(sent)} ({ring / sent:.1f}x) |")
    text = ("### DiLoCoX against DiLoCo and local-only: 8 replicas, N × H, each change alone (issue 18)\n\n"
            f"{STEPS} inner steps of 3×64 tokens per replica (the convergence table's budget), tiny "
            "model, inner lr 1e-3, η = 0.7 Nesterov; DiLoCo at its best μ of "
            f"{' / '.join(map(str, DILOCO_MOMENTA))} in the cell (the NoLoCo grid's runs, the same "
            "seeds); final validation loss, the mean over replicas and seeds. Methods "
            "(benchmarks/grid_jobs.py): `lr4b4` low-rank rank 4 at 4 bits, `id` identity; `arr` "
            "the outer step taken as the group's messages arrive (apply_on_arrival), otherwise "
            "today's overlap (delay 1, own round counted at ½); `d0` no delay (waits for the "
            "messages); `m0.6` outer momentum 0.6 (0.3 otherwise); `l1` a message takes one inner "
            "step to arrive (0 otherwise); `c` each message clipped to the median sender's norm; `i4` the low-rank encoder's 4 power "
            "iterations a round (1 otherwise). Bytes per node per round: every "
            "encoded message to the N − 1 others and the φ digests, against DiLoCo's fp32 ring.\n\n"
            "| N | H | method | seeds | final val loss (per seed) | DiLoCo (best μ) | local | "
            "vs DiLoCo | vs local | sent per round (DiLoCo's / these) |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
            + "\n\nCommand:\n\n    " + command + "\n")
    return text, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--best", default=CANDIDATES[0], help="the candidate run on the second seed "
                   "and in the other cells")
    p.add_argument("--report", action="store_true", help="only the tables, from finished runs")
    p.add_argument("--only", type=int, default=None, help="run only the first ONLY jobs")
    p.add_argument("--jobs-dir", type=Path, default=HERE / "grid_runs")
    p.add_argument("--no-results", action="store_true")
    args = p.parse_args(argv)
    if not args.report:
        run_jobs(all_jobs(args.best)[:args.only], args.jobs_dir, args.processes)
    text, summary = report(load_finished(args.jobs_dir),
                           f".venv/bin/python benchmarks/dilocox_grid.py --best {args.best}")
    publish("dilocox_grid", text, summary, not args.no_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
