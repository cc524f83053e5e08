"""How long a round's end holds the trainer, against its steps: two `join` daemons, one run.

The round's end is what the training thread does between the last inner step of a round and the
first of the next (node/daemon/worker.py, `outer_seconds` in metrics.jsonl): θ copied to the host
(node/train/trainer.py host_parameters), the snapshot or pseudo-gradient encoded, the outer step
on the host, the new weights loaded. Reported per protocol: its median and largest time, in
seconds and in steps (the median inner step of the same run), and the busy fraction, the steps'
own time over the wall clock from the end of the first round to the last step (what else the
thread did: round ends, mid-round corrections, events), and the largest pause between two steps
inside a round (a partner's snapshot applied there).

Both daemons share this machine (and its GPU, if any): their steps are slower than one alone.

    python benchmarks/round_end.py --model small --device cuda --json round_end_gpu.json
    .venv/bin/python benchmarks/round_end.py --model tiny --device cpu --steps 60   # a dry run
    ... --protocols dilocox --beside       # DiLoCoX ending its rounds beside training
    ... --compile on --steps 60            # compiled training (3 rounds of 20 steps)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.config.manifest import Manifest  # noqa: E402
from node.config.schema import model_preset  # noqa: E402
from tests.swarm_harness import SwarmHarness  # noqa: E402


def manifest(protocol: str, args) -> Manifest:
    m = Manifest()
    m.swarm.id = f"round-end-{protocol}"
    for key, value in model_preset(args.model).items():
        setattr(m.model, key, value)
    m.model.vocab_size = args.vocab
    m.data.seq_len = args.seq_len
    t = m.train
    t.micro_batch_size, t.tokens_per_step = args.batch, args.batch * args.seq_len
    t.steps, t.eval_every, t.checkpoint_every, t.device = args.steps, 0, 0, args.device
    t.warmup_steps, t.compile = 10, args.compile
    m.protocol.name, m.protocol.inner_steps = protocol, args.inner_steps
    return m


def summary(events: list[dict], tokens_per_step: int, inner_steps: int) -> dict:
    steps = [e for e in events if e["event"] == "step"]
    rounds = [e for e in events if e["event"] == "round"]
    step_seconds = [tokens_per_step / e["tokens_per_second"] for e in steps]
    median_step = statistics.median(step_seconds[inner_steps:])  # after the first round
    outer = [r["outer_seconds"] for r in rounds]
    later = [e for e in steps if e["step"] > inner_steps]
    wall = later[-1]["time"] - next(e for e in steps if e["step"] == inner_steps)["time"]
    busy = sum(tokens_per_step / e["tokens_per_second"] for e in later) / wall
    # inside a round, the time between two steps that is not the later step's own: a partner's
    # snapshot applied at a step boundary (NoLoCo), a mid-round outer step (DiLoCoX), events
    gaps = [b["time"] - a["time"] - tokens_per_step / b["tokens_per_second"]
            for a, b in zip(later, later[1:]) if a["step"] % inner_steps]
    return {"rounds": len(rounds), "median_step_s": median_step,
            "device_use": [{k: e[k] for k in ("precision", "compute", "micro_batch")}
                           for e in events if e["event"] == "device_use"],
            "outer_s": outer, "outer_median_s": statistics.median(outer),
            "outer_max_s": max(outer), "outer_median_steps": statistics.median(outer) / median_step,
            "outer_max_steps": max(outer) / median_step, "busy_fraction": busy,
            "between_steps_max_s": max(gaps), "between_steps_total_s": sum(gaps),
            # the worker's own account of it; NoLoCo's corrections: held, of which waiting on
            # the loop, decoding, checking and φ's digest (the rest: the correction itself)
            "between_steps_s": [r.get("between_steps_seconds") for r in rounds],
            "network_wait_s": [r.get("network_wait_seconds") for r in rounds],
            "pair_corrections": [{k: e.get(k) for k in ("seconds", "wait_seconds", "decode_seconds",
                                                        "check_seconds", "digest_seconds")}
                                 for e in events if e["event"] == "pair_correction"],
            "exchanged_rounds": sum(bool(r.get("partner") or len(r.get("group") or []) > 1)
                                    for r in rounds)}


def run(protocol: str, args, base: Path) -> list[dict]:
    m = manifest(protocol, args)
    harness = SwarmHarness(base / protocol, m)
    try:
        extra = ["--round-end", "beside"] if args.beside and protocol == "dilocox" else []
        nodes = harness.start(2, extra=extra, timeout=180)
        for node in nodes:
            node.wait_for(lambda ev: any(e["event"] == "trained" for e in ev), args.timeout,
                          "the last step")
        return [summary(node.events(), m.train.tokens_per_step, args.inner_steps)
                for node in nodes]
    finally:
        harness.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--protocols", default="noloco,dilocox")
    parser.add_argument("--beside", action="store_true",
                        help="DiLoCoX daemons with --round-end beside (its end in a thread)")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                        help="train.compile of both daemons (auto: on CUDA)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="round-end-") as base:
        for protocol in args.protocols.split(","):
            results[protocol] = run(protocol, args, Path(base))
            print(f"| {protocol} | " + " | ".join(
                f"{n['median_step_s']:.3f} s, round end {n['outer_median_s']:.3f} s median "
                f"({n['outer_median_steps']:.1f} steps), {n['outer_max_s']:.3f} s max "
                f"({n['outer_max_steps']:.1f}), between steps {n['between_steps_max_s']:.3f} s max, "
                f"busy {n['busy_fraction']:.1%}, "
                f"{n['exchanged_rounds']}/{n['rounds']} rounds exchanged, "
                f"{n['device_use'][-1]['compute'] if n['device_use'] else '?'}"
                for n in results[protocol]) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args)
                                         | {"json": str(args.json)}, "nodes": results}, indent=2))


if __name__ == "__main__":
    main()
