"""A model-size ladder: each method's gap to DiLoCo and to data-parallel as the model grows.

8 replicas of each size, every method at the simulator's defaults (the swarm manifest's for
NoLoCo and DiLoCoX, DiLoCo at its best measured outer step; node/simulator/settings.py), with
the daemon's round code:
- data-parallel (every step all-reduced), DiLoCo at H, DiLoCoX at H (its shipped code),
  local-only;
- NoLoCo at H and at H/2: the NoLoCo paper's setting, which communicates twice as often as
  DiLoCo at H, against DiLoCo at H at equal tokens, with the bytes each sends.

The token budget scales with the size: each replica trains on TOKENS_PER_PARAMETER tokens per
parameter (the swarm on 8 times that; --tokens-per-parameter sets another), in steps of the size's batch (sequences of 64 tokens),
rounded down to a whole number of rounds of H; inner AdamW, peak lr 1e-3, warm-up 40, cosine to
0.1×, 16 validation batches (benchmarks/convergence.py), one torch thread per job. The two
smallest sizes run two seeds, the others one.

    nice -n 19 .venv/bin/python benchmarks/ladder.py --sizes xs        # one rung
    nice -n 19 .venv/bin/python benchmarks/ladder.py                   # the CPU ladder, xs to l
    .venv/bin/python benchmarks/ladder.py --sizes xl,xxl --device cuda --tokens-per-parameter 0.05
    .venv/bin/python benchmarks/ladder.py --report                     # the tables so far

Each run is its own JSON file in benchmarks/ladder_runs/ (an interrupted ladder resumes); the
summary, with the fitted trend, goes to benchmarks/ladder.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from grid_jobs import Job, load_finished, run_jobs  # noqa: E402
from node.config.manifest import SCHEMA_VERSIONS  # noqa: E402
from node.simulator.report import human_bytes, markdown_table  # noqa: E402
from node.simulator.settings import DEFAULT_INNER_STEPS  # noqa: E402

WORKERS = 8
H = DEFAULT_INNER_STEPS["diloco"]   # the manifest's, every method's default
SEQ_LEN = 64
TOKENS_PER_PARAMETER = 1.0
# Charles et al., "Scaling Laws for DiLoCo" (arXiv 2503.09799), Table 4: DiLoCo with 8 replicas
# against data-parallel, by parameters
PUBLISHED_DILOCO_GAP = {35e6: 0.039, 180e6: 0.023, 1.3e9: 0.013}
TARGET_GAP = 0.02
BYTE_VOCABULARY = 256   # the embedded stdlib corpus's


@dataclass(frozen=True)
class Size:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    micro_batch: int         # sequences of SEQ_LEN tokens a step
    seeds: tuple[int, ...]

    @property
    def parameters(self) -> int:
        """With the byte vocabulary of the embedded corpus (what the runs train)."""
        return parameters_of(self.dim, self.n_layers, self.n_heads, self.ffn_hidden)

    def steps(self, tokens_per_parameter: float) -> int:
        """Inner steps per replica: the scaled token budget in whole rounds of H."""
        tokens = tokens_per_parameter * self.parameters
        return max(1, int(tokens // (self.micro_batch * SEQ_LEN) // H)) * H

    def overrides(self, device: str) -> tuple[str, ...]:
        return (f"model.dim={self.dim}", f"model.n_layers={self.n_layers}",
                f"model.n_heads={self.n_heads}", f"model.ffn_hidden={self.ffn_hidden}",
                f"train.micro_batch_size={self.micro_batch}",
                f"train.tokens_per_step={self.micro_batch * SEQ_LEN}", f'train.device="{device}"')


@functools.cache
def parameters_of(dim: int, n_layers: int, n_heads: int, ffn_hidden: int) -> int:
    from node.config.schema import ModelConfig
    from node.train.model import build_model, count_parameters
    config = ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_hidden=ffn_hidden,
                         max_seq_len=SEQ_LEN)
    return count_parameters(build_model(config, BYTE_VOCABULARY, "meta"))


# parameters: xs 0.14M, s 0.71M, m 1.87M (the tiny preset), l 8.5M; xl 27.5M, xxl 85M
SIZES = (
    Size("xs", 64, 2, 4, 192, micro_batch=3, seeds=(0, 1)),
    Size("s", 128, 3, 4, 384, micro_batch=6, seeds=(0, 1)),
    Size("m", 192, 4, 6, 512, micro_batch=12, seeds=(0,)),
    Size("l", 320, 6, 8, 1024, micro_batch=24, seeds=(0,)),
    # a GPU's rungs (--device cuda)
    Size("xl", 512, 8, 8, 1536, micro_batch=48, seeds=(0,)),
    Size("xxl", 768, 12, 12, 2048, micro_batch=96, seeds=(0,)),
)
# method key: (simulator method, H)
METHODS = {"data-parallel": ("data-parallel", H), "diloco": ("diloco", H), "noloco": ("noloco", H),
           "noloco-half": ("noloco", H // 2), "dilocox": ("dilocox", H), "local": ("local", H)}


@dataclass(frozen=True)
class Budget:
    tokens_per_parameter: float = TOKENS_PER_PARAMETER
    device: str = "cpu"


def job(size: Size, method: str, seed: int, budget: Budget) -> Job:
    """The run of `method` on `size`; NoLoCo's and DiLoCoX's at today's manifest schema version
    of their defaults, named in the run file (`noloco.v1`), so that runs of earlier defaults
    never stand in for today's."""
    name, h = METHODS[method]
    return Job(WORKERS, h, name, seed, rounds=size.steps(budget.tokens_per_parameter) // h,
               model=size.overrides(budget.device), tag=f"{size.name}-T{budget.tokens_per_parameter:g}",
               schema=SCHEMA_VERSIONS.get(name, 0))


def fit_power_law(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(a, b) of gap = a·parameters^b, least squares in log-log, over positive gaps; None with
    fewer than two sizes."""
    points = [(math.log(p), math.log(g)) for p, g in points if g > 0]
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return math.exp(my - b * mx), b


def report(finished: dict[str, dict], budget: Budget) -> tuple[str, dict]:
    """The ladder's table, the trend of each method's gap to data-parallel, and its summary."""
    rows, summary, gaps = [], {}, {}
    for size in SIZES:
        # the seeds every method finished: a rung's methods are compared on the same seeds
        seeds = [s for s in size.seeds
                 if all(job(size, m, s, budget).key in finished for m in METHODS)]
        if not seeds:
            continue
        losses, sent = {}, {}
        for method in METHODS:
            runs = [finished[job(size, method, s, budget).key] for s in seeds]
            losses[method] = sum(r["final_val_loss"] for r in runs) / len(runs)
            sent[method] = runs[0]["rounds"][-1]["bytes_sent_per_replica"]
        dp, diloco = losses["data-parallel"], losses["diloco"]
        steps = size.steps(budget.tokens_per_parameter)
        entry = {"parameters": size.parameters, "steps": steps, "seeds": seeds,
                 "tokens_per_replica": steps * size.micro_batch * SEQ_LEN, "methods": {}}
        for method, loss in losses.items():
            entry["methods"][method] = {"final_val_loss": loss, "vs_diloco": (loss - diloco) / diloco,
                                        "vs_data_parallel": (loss - dp) / dp,
                                        "bytes_per_replica": sent[method]}
            gaps.setdefault(method, []).append((size.parameters, (loss - dp) / dp))
            name, h = METHODS[method]
            rows.append({"size": f"{size.name} ({size.parameters / 1e6:.2f}M)",
                         "tokens / replica": f"{entry['tokens_per_replica']:,}",
                         "seeds": str(len(seeds)),
                         "method": f"{name}/{SCHEMA_VERSIONS[name]} H={h}" if name in SCHEMA_VERSIONS
                         else f"{name} H={h}",
                         "final val loss": f"{loss:.4f}",
                         "vs DiLoCo": f"{100 * (loss - diloco) / diloco:+.2f}%",
                         "vs data-parallel": f"{100 * (loss - dp) / dp:+.2f}%",
                         "sent / replica": human_bytes(sent[method])})
        half, full = entry["methods"]["noloco-half"], entry["methods"]["diloco"]
        entry["noloco_half_vs_diloco"] = {
            "loss": half["vs_diloco"],
            "bytes_ratio": full["bytes_per_replica"] / half["bytes_per_replica"]}
        summary[size.name] = entry
    lines = [markdown_table(rows) if rows else "(no finished rung)", ""]
    for name, entry in summary.items():
        pair = entry["noloco_half_vs_diloco"]
        lines.append(f"- {name}: NoLoCo at H/2 = {H // 2} against DiLoCo at H = {H}, equal tokens: "
                     f"{100 * pair['loss']:+.2f}% loss, DiLoCo sends {pair['bytes_ratio']:.1f}x "
                     "its bytes.")
    trends = {}
    for method, points in gaps.items():
        fit = fit_power_law(points)
        if method == "data-parallel" or fit is None:
            continue
        a, b = fit
        reach = (TARGET_GAP / a) ** (1 / b) if b < 0 else None
        trends[method] = {"a": a, "b": b, "parameters_at_2pct": reach, "points": points}
        where = f"{reach:.3g} parameters" if reach else "never (the gap does not shrink)"
        lines.append(f"- {method}: gap to data-parallel ≈ {a:.3g}·P^{b:.3f} over "
                     f"{len(points)} sizes; 2% at {where}.")
    published = ", ".join(f"{p / 1e6:g}M {100 * g:+.1f}%" for p, g in PUBLISHED_DILOCO_GAP.items())
    lines.append(f"- published DiLoCo (8 replicas) against data-parallel: {published}.")
    summary["trends"] = trends
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="xs,s,m,l", help="comma-separated rungs (default xs,s,m,l; "
                   f"all: {','.join(s.name for s in SIZES)})")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--tokens-per-parameter", type=float, default=TOKENS_PER_PARAMETER,
                   help=f"each replica's token budget per parameter (default {TOKENS_PER_PARAMETER:g})")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--seeds", help="comma-separated seeds to run of each rung's (default: its own)")
    p.add_argument("--report", action="store_true", help="only the tables, from finished runs")
    p.add_argument("--out-dir", type=Path, default=HERE / "ladder_runs", help="the runs' JSON files "
                   "(default benchmarks/ladder_runs)")
    p.add_argument("--summary", type=Path, default=HERE / "ladder.json")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in SIZES}
    unknown = [n for n in args.sizes.split(",") if n not in by_name]
    if unknown:
        p.error(f"--sizes names {unknown[0]!r}, not a rung: choose from {', '.join(by_name)}.")
    if args.tokens_per_parameter <= 0:
        p.error(f"--tokens-per-parameter must be > 0, got {args.tokens_per_parameter}.")
    budget = Budget(args.tokens_per_parameter, args.device)
    if not args.report:
        sizes = [by_name[n] for n in args.sizes.split(",")]
        chosen = None if args.seeds is None else {int(x) for x in args.seeds.split(",")}
        run_jobs([job(s, m, seed, budget) for s in sizes for seed in s.seeds
                  if chosen is None or seed in chosen for m in METHODS], args.out_dir, args.processes)
    text, summary = report(load_finished(args.out_dir), budget)
    print(text)
    args.summary.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
