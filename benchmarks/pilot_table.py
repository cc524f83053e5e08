"""Joins several convergence.py runs (each its own --out-dir) into one table and one JSON.

Pilots run one method per process, so that a busy machine can run them in any order:

    .venv/bin/python benchmarks/pilot_table.py --out benchmarks/dilocox_pilots.json \
        diloco=/tmp/dx/p1 local=/tmp/dx/local topk=/tmp/dx/topk-half ...

The first run named `diloco` and the one named `local` are the references of the two gap
columns; bytes are per replica per round, and DiLoCo's ring all-reduce of fp32 over them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the joined JSON")
    p.add_argument("runs", nargs="+", metavar="NAME=DIR", help="a convergence.py --out-dir")
    p.add_argument("--diloco-loss", type=float, help="DiLoCo's final loss, where its run left a "
                   "log but no JSON (the table says so)")
    p.add_argument("--diloco-bytes", type=float, help="DiLoCo's bytes per replica per round, with it")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    runs = {}
    for item in args.runs:
        name, _, folder = item.partition("=")
        (result,) = json.loads((Path(folder) / "convergence.json").read_text())
        runs[name] = result
    diloco, local = runs.get("diloco"), runs.get("local")
    if diloco is None and args.diloco_loss:  # a reference from a log: loss and bytes only
        diloco = {"final_val_loss": args.diloco_loss, "settings": {"rounds": 1},
                  "rounds": [{"bytes_sent_per_replica": args.diloco_bytes}]}
        print(f"(DiLoCo: {args.diloco_loss} and {args.diloco_bytes:,.0f} bytes a round, from its log)\n")

    def per_round(result: dict) -> float:
        return result["rounds"][-1]["bytes_sent_per_replica"] / result["settings"]["rounds"]

    print("| run | method | final val loss | vs DiLoCo | vs local | sent per replica per round | "
          "DiLoCo fp32 ring / these |")
    print("|---|---|---|---|---|---|---|")
    for name, result in runs.items():
        loss = result["final_val_loss"]
        gap = lambda ref: f"{100 * (loss - ref['final_val_loss']) / ref['final_val_loss']:+.2f}%" \
            if ref else "-"  # noqa: E731
        sent = per_round(result)
        ratio = f"{per_round(diloco) / sent:.3g}x" if diloco and sent else "-"
        extra = result["settings"].get("protocol_values") or {}
        label = result["method"] + (" " + ", ".join(f"{k}={v}" for k, v in extra.items()) if extra else "")
        if result["settings"].get("latency_steps"):
            label += f", messages take {result['settings']['latency_steps']} steps"
        print(f"| {name} | {label} | {loss:.4f} | {gap(diloco)} | {gap(local)} | "
              f"{sent / 1024:,.0f} KiB | {ratio} |")
    args.out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
