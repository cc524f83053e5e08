"""One simulated run of a grid (benchmarks/noloco_grid.py, benchmarks/dilocox_grid.py), named by
its method string, written to its own JSON file as it ends, so that an interrupted grid resumes
where it stopped and both grids share their DiLoCo and local-only references.

Every job runs on the convergence table's budget: STEPS inner steps of 3×64 tokens per replica,
inner lr 1e-3, the tiny model, evaluated every 50 steps.

Method strings:
- "noloco", "dilocox", "diloco", "local", "data-parallel": the simulator's defaults, what a swarm's
  manifest ships (DiLoCo's: its best measured outer step; node/simulator/settings.py);
- "diloco-<μ>" (η = 0.7, Nesterov);
- "noloco-new[-a<α>][-g<β = γ>][-w<wire dtype>][-sr]" (θ alone, in int8 unless w names another
  wire dtype, rounded to nearest unless "sr": stochastically), "noloco-old" (φ and Δ in bf16);
- "dilocox-<codec>[-arr][-d0][-m<μ>][-e<η>][-r<decay>][-l<steps>]": codec "lr<rank>b<bits>"
  (low-rank), "topk[<k>]" (k of every 4096, the manifest's 64 and 2 bits otherwise) or "id"
  (identity); "arr" takes the outer step as the group's messages arrive (apply_on_arrival);
  "d0" waits for the round's messages (delay 0); "m<μ>" and "e<η>" the outer momentum and
  learning rate (the manifest's 0.3 and 0.7 otherwise); "r<decay>" the error feedback's decay
  (1 otherwise); "l<steps>" a message's travel time in inner steps (0 otherwise); "c" scales
  each message down to the median sender's norm (clip_to_median); "i<n>" the low-rank encoder's
  power iterations a round (power_iterations; 1 otherwise).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from convergence import node_config, parse_args as convergence_args, write_block  # noqa: E402
from node.data.corpus import load_corpus  # noqa: E402
from node.simulator import SimulationSettings, run_simulation  # noqa: E402

STEPS = 800
SHIPPED = ("noloco", "dilocox", "diloco", "local", "data-parallel")
NEW_PAYLOAD = {"snapshot": "theta", "wire_dtype": "int8"}
OLD_PAYLOAD = {"snapshot": "phi_delta", "wire_dtype": "bf16"}


def dilocox_settings(method: str) -> dict:
    """SimulationSettings keywords of a "dilocox-..." method string."""
    codec, *options = method.split("-")[1:]
    # manifest [protocol] keys the settings have no field for; the names keep their meaning
    # when the manifest's default changes
    values = {"clip_to_median": False, "power_iterations": 1}
    if codec.startswith("lr"):
        rank, bits = codec[2:].split("b")
        kwargs = {"codec": "lowrank", "rank": int(rank), "bits": int(bits)}
    elif codec.startswith("topk"):
        kwargs = {"codec": "topk"}
        if codec[4:]:
            values["topk_k"] = int(codec[4:])
    else:
        kwargs = {"codec": {"id": "identity"}[codec]}
    for option in options:
        if option == "arr":
            values["apply_on_arrival"] = True
        elif option == "d0":
            kwargs["delay"] = 0
        elif option.startswith("m"):
            kwargs["outer_momentum"] = float(option[1:])
        elif option.startswith("l"):
            kwargs["latency_steps"] = int(option[1:])
        elif option.startswith("e"):
            kwargs["outer_lr"] = float(option[1:])
        elif option.startswith("r"):
            values["residual_decay"] = float(option[1:])
        elif option == "c":
            values["clip_to_median"] = True
        elif option.startswith("i"):
            values["power_iterations"] = int(option[1:])
        else:
            raise ValueError(f"DiLoCoX option {option!r} of {method!r} is unknown: use arr, d0, "
                             "m<μ>, e<η>, r<decay>, l<steps>, c or i<n>.")
    return {**kwargs, "protocol_values": values}


def noloco_settings(method: str) -> dict:
    """SimulationSettings keywords of a "noloco-..." method string."""
    payload, *options = method.split("-")[1:]
    kwargs = dict(NEW_PAYLOAD if payload == "new" else OLD_PAYLOAD)
    # manifest [protocol] keys the settings have no field for; the names keep their meaning
    # when the manifest's default rounding changes
    values = {"wire_rounding": "nearest"}
    for option in options:
        if option.startswith("a"):
            kwargs["noloco_momentum"] = float(option[1:])
        elif option.startswith("g"):
            kwargs["noloco_progress_weight"] = kwargs["noloco_consensus_weight"] = float(option[1:])
        elif option.startswith("w"):
            kwargs["wire_dtype"] = option[1:]
        elif option == "sr":
            values["wire_rounding"] = "stochastic"
        else:
            raise ValueError(f"NoLoCo option {option!r} of {method!r} is unknown: use a<α>, g<γ>, "
                             "w<wire dtype> or sr.")
    return {**kwargs, "protocol_values": values}


@dataclass(frozen=True)
class Job:
    workers: int
    inner_steps: int
    method: str          # see the module's docstring
    seed: int
    rounds: int | None = None        # None: STEPS // inner_steps
    model: tuple[str, ...] = ()      # node-config overrides, e.g. ("model.dim=64",); () the tiny model
    tag: str = ""                    # names the model (and rounds) in the key where they are set
    # a shipped swarm protocol's manifest schema version (node/config/manifest.py SCHEMA_VERSIONS),
    # named in the key as "<method>.v<n>" where set: "noloco" and "dilocox" run the manifest's
    # defaults, which change with it, so a run of earlier defaults is never taken for today's
    schema: int = 0

    @property
    def key(self) -> str:
        prefix = f"{self.tag}-" if self.tag else ""
        method = f"{self.method}.v{self.schema}" if self.schema else self.method
        return f"{prefix}N{self.workers}-H{self.inner_steps}-{method}-s{self.seed}"

    def settings(self) -> SimulationSettings:
        common = {"workers": self.workers, "seed": self.seed, "inner_steps": self.inner_steps,
                  "rounds": self.rounds or STEPS // self.inner_steps,
                  # evaluate every 50 steps in every cell: the same evaluation cost per token
                  "eval_every": max(1, 50 // self.inner_steps)}
        if self.method in SHIPPED:
            return SimulationSettings(self.method, **common)
        if self.method.startswith("noloco"):
            return SimulationSettings("noloco", timing="overlap", **noloco_settings(self.method),
                                      **common)
        if self.method.startswith("dilocox"):
            return SimulationSettings("dilocox", **dilocox_settings(self.method), **common)
        if self.method.startswith("diloco"):
            return SimulationSettings("diloco", outer_lr=0.7,
                                      outer_momentum=float(self.method.split("-")[1]), **common)
        return SimulationSettings("local", **common)


def run_job(job: Job, out_dir: Path) -> str:
    args = convergence_args([arg for override in job.model for arg in ("--set", override)])
    config = node_config(args)
    settings = job.settings()
    result = run_simulation(settings, config, load_corpus(config.data))
    data = {"job": job.__dict__, **result.to_dict(), "protocol_section": protocol_section(settings)}
    path = out_dir / f"{job.key}.json"
    path.with_suffix(".tmp").write_text(json.dumps(data) + "\n", encoding="utf-8")
    path.with_suffix(".tmp").rename(path)
    return f"{job.key}: {result.final_val_loss:.4f} ({result.final.wall_seconds / 60:.1f} min)"


def protocol_section(settings: SimulationSettings) -> dict | None:
    """The manifest [protocol] section a NoLoCo or DiLoCoX run ran (every key, defaults filled
    in), recorded in its JSON so that a reader can check it against what the job runs now."""
    if settings.protocol not in ("noloco", "dilocox"):
        return None
    return asdict(settings.validated().sections()[0])


def run_jobs(jobs: list[Job], out_dir: Path, processes: int) -> None:
    """Runs the jobs not yet finished in `out_dir`, `processes` at a time, in the given order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    todo = [j for j in jobs if not (out_dir / f"{j.key}.json").exists()]
    print(f"{len(todo)} jobs to run, {processes} at a time", flush=True)
    with ProcessPoolExecutor(processes) as pool:
        futures = [pool.submit(run_job, j, out_dir) for j in todo]
        for future in as_completed(futures):
            print(f"[{(time.perf_counter() - started) / 60:5.1f} min] {future.result()}", flush=True)


def publish(name: str, text: str, summary: dict, write_results: bool) -> None:
    """Prints a grid's table, writes its summary to benchmarks/<name>.json and, unless told not
    to, its block of benchmarks/NOTEBOOK.md (marker "<name with - for _>")."""
    print(text)
    (HERE / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if write_results:
        write_block(HERE / "NOTEBOOK.md", name.replace("_", "-"), text)


def load_finished(out_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in out_dir.glob("*.json")}


def per_round_bytes(run: dict) -> float:
    last = run["rounds"][-1]
    return last["bytes_sent_per_replica"] / last["round"]


def main(argv: list[str] | None = None) -> int:
    """Runs single jobs outside a grid, named N:H:method:seed, e.g.
    `.venv/bin/python benchmarks/grid_jobs.py 8:25:dilocox-lr16b8-arr-l1-m0.6:0 8:10:diloco-0.6:0`."""
    import argparse
    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("jobs", nargs="+", help="N:H:method:seed")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=HERE / "grid_runs")
    args = p.parse_args(argv)
    jobs = []
    for spec in args.jobs:
        workers, inner_steps, method, seed = spec.split(":")
        jobs.append(Job(int(workers), int(inner_steps), method, int(seed)))
    run_jobs(jobs, args.out_dir, args.processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
