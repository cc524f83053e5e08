"""The shipped defaults on settings nobody tuned them on: NoLoCo, DiLoCoX, DiLoCo and local-only.

Every protocol runs as `lowcomm-node simulate` runs it when given nothing but the setting: the
swarm manifest's defaults for NoLoCo and DiLoCoX, DiLoCo at its best measured outer step
(node/simulator/settings.py), at the setting's H, replicas, rounds, model and seed. Inner
training is the convergence table's (benchmarks/convergence.py: 3×64 tokens a step, AdamW peak
lr 1e-3, warm-up 40, cosine to 0.1×, 16 validation batches), one torch thread per job.

SETTINGS was fixed when this script was written, before any of its runs: a setting is never
changed after its result is seen. Where a protocol's defaults end above local-only on one, the
remedy is in the defaults, and the table is run again on the same settings.

    nice -n 19 .venv/bin/python benchmarks/heldout.py            # the runs not yet done, then the table
    nice -n 19 .venv/bin/python benchmarks/heldout.py --methods dilocox   # only DiLoCoX's missing runs
    .venv/bin/python benchmarks/heldout.py --report              # the table from finished runs
    .venv/bin/python benchmarks/heldout.py --report --schema dilocox/1    # of earlier defaults

Each run is its own JSON file in benchmarks/heldout_runs/ (an interrupted set resumes); the
summary goes to benchmarks/heldout.json. NoLoCo's and DiLoCoX's files name the manifest schema
version whose defaults they ran ("s1-N4-H10-dilocox.v2-s1.json"; node/config/manifest.py
SCHEMA_VERSIONS): when a default changes, its version does, and the runs of the earlier
defaults stay on disk beside the new ones, never taken for them. DiLoCo and local-only do not
change with a manifest, and their runs serve every version. A run file that recorded its
[protocol] section and differs from what its job runs now stops the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from grid_jobs import Job, load_finished, per_round_bytes, protocol_section, run_jobs  # noqa: E402
from node.config.manifest import SCHEMA_VERSIONS  # noqa: E402
from node.simulator.report import human_bytes, markdown_table  # noqa: E402

METHODS = ("noloco", "dilocox", "diloco", "local")
COMPARED = ("noloco", "dilocox", "diloco")
OUT_DIR = HERE / "heldout_runs"


@dataclass(frozen=True)
class Setting:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    workers: int
    inner_steps: int
    rounds: int
    seed: int

    def model(self) -> tuple[str, ...]:
        return (f"model.dim={self.dim}", f"model.n_layers={self.n_layers}",
                f"model.n_heads={self.n_heads}", f"model.ffn_hidden={self.ffn_hidden}")

    def job(self, method: str, schemas: dict[str, int] = SCHEMA_VERSIONS) -> Job:
        """The run of `method` at the defaults of `schemas`' version of its protocol (today's)."""
        return Job(self.workers, self.inner_steps, method, self.seed, rounds=self.rounds,
                   model=self.model(), tag=self.name, schema=schemas.get(method, 0))


# Fixed before any run: widths 64-128, depths 2-4, 4-16 replicas, H 10-50, a seed each, none of
# them the tiny model or a cell of the tuning grids; ordered cheapest first.
SETTINGS = (
    Setting("s1", dim=64, n_layers=2, n_heads=4, ffn_hidden=192, workers=4, inner_steps=10, rounds=32, seed=1),
    Setting("s2", dim=128, n_layers=4, n_heads=8, ffn_hidden=384, workers=4, inner_steps=30, rounds=24, seed=2),
    Setting("s3", dim=128, n_layers=2, n_heads=4, ffn_hidden=384, workers=16, inner_steps=10, rounds=24, seed=3),
    Setting("s4", dim=96, n_layers=3, n_heads=6, ffn_hidden=256, workers=8, inner_steps=20, rounds=24, seed=4),
    Setting("s5", dim=96, n_layers=2, n_heads=4, ffn_hidden=256, workers=12, inner_steps=25, rounds=24, seed=5),
    Setting("s6", dim=64, n_layers=4, n_heads=4, ffn_hidden=192, workers=8, inner_steps=50, rounds=24, seed=6),
)


def relative(value: float, reference: float) -> str:
    return f"{100 * (value - reference) / reference:+.2f}%"


def check_current(finished: dict[str, dict]) -> None:
    """Refuses (SystemExit) a run file of today's schema versions that recorded a [protocol]
    section other than what its job runs now: its name claims defaults it did not run."""
    for s in SETTINGS:
        for m in SCHEMA_VERSIONS:
            job = s.job(m)
            run = finished.get(job.key)
            recorded = run and run.get("protocol_section")
            if recorded and recorded != protocol_section(job.settings()):
                now = protocol_section(job.settings())
                changed = sorted(k for k in now if recorded.get(k) != now[k])
                raise SystemExit(f"{OUT_DIR / job.key}.json ran other [protocol] values than "
                                 f"{m}/{SCHEMA_VERSIONS[m]}'s defaults ({', '.join(changed)}): "
                                 "delete it, or bump the schema version whose defaults changed.")


def report(finished: dict[str, dict], schemas: dict[str, int] = SCHEMA_VERSIONS) -> tuple[str, dict]:
    """The table (a row per setting and protocol) and its JSON summary, of the finished runs of
    the swarm protocols' defaults at `schemas`' versions."""
    rows, summary = [], {}
    for s in SETTINGS:
        runs = {m: finished.get(s.job(m, schemas).key) for m in METHODS}
        if runs["local"] is None:
            continue
        local = runs["local"]["final_val_loss"]
        diloco = runs["diloco"]["final_val_loss"] if runs["diloco"] else None
        entry = {"setting": s.__dict__, "parameters": runs["local"]["parameters"],
                 "local": local, "methods": {}}
        for m in COMPARED:
            run = runs[m]
            if run is None:
                continue
            loss = run["final_val_loss"]
            sent = per_round_bytes(run)
            schema = f"{m}/{schemas[m]}" if m in schemas else None
            entry["methods"][m] = {"method": run["method"], "schema": schema, "final_val_loss": loss,
                                   "vs_local": (loss - local) / local,
                                   "vs_diloco": None if diloco is None else (loss - diloco) / diloco,
                                   "bytes_per_round": sent,
                                   "minutes": run["rounds"][-1]["wall_seconds"] / 60}
            rows.append({"setting": s.name,
                         "model": f"{runs['local']['parameters'] / 1e6:.2f}M (d{s.dim} L{s.n_layers})",
                         "N": str(s.workers), "H": str(s.inner_steps), "rounds": str(s.rounds),
                         "seed": str(s.seed),
                         "protocol": run["method"], "defaults": schema or "-",
                         "final val loss": f"{loss:.4f}",
                         "local-only": f"{local:.4f}", "vs local-only": relative(loss, local),
                         "vs DiLoCo": "-" if diloco is None else relative(loss, diloco),
                         "sent a round": human_bytes(sent)})
        summary[s.name] = entry
    return markdown_table(rows) if rows else "(no finished setting)", summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", action="store_true", help="only the table, from finished runs")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--only", help="comma-separated setting names, e.g. s1,s2 (default: all)")
    p.add_argument("--methods", help=f"comma-separated methods to run, of {', '.join(METHODS)} "
                   "(default: all); the table shows every finished run")
    p.add_argument("--schema", action="append", default=[], metavar="PROTOCOL/N",
                   help="with --report: the table of an earlier schema version's defaults, "
                   "e.g. dilocox/1 (repeatable; heldout.json is left as it is)")
    args = p.parse_args(argv)
    chosen = [s for s in SETTINGS if not args.only or s.name in args.only.split(",")]
    if args.only and len(chosen) != len(args.only.split(",")):
        p.error(f"--only {args.only!r} names a setting that is not one of "
                f"{', '.join(s.name for s in SETTINGS)}.")
    methods = args.methods.split(",") if args.methods else list(METHODS)
    if not set(methods) <= set(METHODS):
        p.error(f"--methods {args.methods!r} names a method that is not one of {', '.join(METHODS)}.")
    schemas = dict(SCHEMA_VERSIONS)
    for tag in args.schema:
        protocol, _, version = tag.partition("/")
        if protocol not in schemas or not version.isdigit() or not 1 <= int(version) <= schemas[protocol]:
            p.error(f"--schema {tag!r} is not one of the versions this release knows: "
                    + ", ".join(f"{m}/1..{n}" for m, n in SCHEMA_VERSIONS.items()) + ".")
        schemas[protocol] = int(version)
    if args.schema and not args.report:
        p.error("--schema reports the runs of earlier defaults, which this release cannot run: add --report.")
    finished = load_finished(OUT_DIR)
    check_current(finished)
    if not args.report:
        run_jobs([s.job(m) for s in chosen for m in METHODS if m in methods], OUT_DIR, args.processes)
        finished = load_finished(OUT_DIR)
        check_current(finished)
    text, summary = report(finished, schemas)
    print(text)
    if not args.schema:
        (HERE / "heldout.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
