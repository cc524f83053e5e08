"""What a DiLoCoX codec keeps per byte, on real pseudo-gradients (issue 18).

One replica of the convergence benchmark's model trains alone for R rounds of H steps; each
round's pseudo-gradient Δ_r = θ_start − θ_end is recorded. Every codec setting then compresses
the same sequence with error feedback, as protocol/dilocox.py does (x = Δ_r + e ; c = C(x) ;
e ← x − D(c)), and we report per message:

- bytes: exact encoded size (payload + description), and fp32 bytes / these;
- kept: 1 − ‖x − D(c)‖² / ‖x‖², the share of the round's target a message reconstructs, mean
  over rounds (the same measure for every codec: quantization error counts);
- caught up: 1 − ‖e_R‖² / ‖Σ Δ‖², how much of all rounds' work was sent by the end.

    nice -n 10 .venv/bin/python benchmarks/codec_energy.py            # writes NOTEBOOK.md block
    nice -n 10 .venv/bin/python benchmarks/codec_energy.py --rounds 4 --no-results   # a pilot
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's node/ and protocol/

from benchmarks.convergence import write_block  # noqa: E402
from node.config.schema import load_config  # noqa: E402
from node.data.corpus import load_corpus  # noqa: E402
from node.simulator.replica import build_replicas  # noqa: E402
from node.simulator.report import markdown_table  # noqa: E402
from protocol.codecs import get_codec  # noqa: E402
from protocol.tensors import NamedTensors, difference, numel  # noqa: E402

HERE = Path(__file__).resolve().parent
SETTINGS = ([("topk", {"k": k, "chunk": 4096, "bits": 2}) for k in (16, 32, 64, 128)]
            + [("topk", {"k": 64, "chunk": 4096, "bits": 4})]
            + [("lowrank", {"rank": r, "bits": b}) for b in (8, 4) for r in (1, 2, 4, 8)])


def record_deltas(args) -> tuple[list[NamedTensors], int]:
    """Δ of each round of one replica trained alone; and the model's parameter count."""
    config = load_config(None, [f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
                                f"train.tokens_per_step={args.micro_batch * args.seq_len}",
                                "train.lr=1e-3", "train.warmup_steps=40", "train.threads=1",
                                'train.device="cpu"', 'model.preset="tiny"',
                                f"train.steps={args.rounds * args.inner_steps}"])
    corpus = load_corpus(config.data)
    replica = build_replicas(1, config.model, config.train, corpus, args.seq_len, args.seed,
                             torch.device("cpu"))[0]
    deltas = []
    for _ in range(args.rounds):
        start = replica.weights()
        replica.train(args.inner_steps)
        deltas.append(difference(start, replica.weights()))
    return deltas, numel(deltas[0])


def measure(name: str, params: dict, deltas: list[NamedTensors]) -> dict:
    """Error feedback over the rounds; the numbers of the module docstring."""
    codec = get_codec(name, **params)
    residual = {n: torch.zeros_like(t) for n, t in deltas[0].items()}
    total = {n: torch.zeros_like(t) for n, t in deltas[0].items()}
    kept, sizes = [], []
    for delta in deltas:
        error, norm, size = 0.0, 0.0, 0
        for n, d in delta.items():
            target = d + residual[n]
            encoded = codec.encode(target, n)
            decoded = codec.decode(encoded.description, encoded.payload, max_elements=max(target.numel(), 1))
            residual[n] = target - decoded
            total[n] += d
            error += float(residual[n].square().sum())
            norm += float(target.square().sum())
            size += encoded.size_bytes
        kept.append(1 - error / norm)
        sizes.append(size)
    left = sum(float(e.square().sum()) for e in residual.values())
    work = sum(float(t.square().sum()) for t in total.values())
    return {"codec": name, "params": params, "bytes": sum(sizes) / len(sizes),
            "kept_per_round": kept, "kept": sum(kept) / len(kept), "caught_up": 1 - left / work}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "codec_energy.json")
    p.add_argument("--no-results", action="store_true", help="do not touch NOTEBOOK.md (pilots)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    deltas, parameters = record_deltas(args)
    results = [measure(name, params, deltas) for name, params in SETTINGS]
    seconds = time.perf_counter() - started
    args.out.write_text(json.dumps({"parameters": parameters, "rounds": args.rounds,
                                    "inner_steps": args.inner_steps, "results": results}, indent=1))
    rows = [{"codec": f"{r['codec']}({', '.join(f'{k}={v}' for k, v in r['params'].items())})",
             "bytes per message": f"{r['bytes']:,.0f}", "fp32 / these": f"{4 * parameters / r['bytes']:.0f}x",
             "kept per round (mean)": f"{r['kept']:.3f}", "caught up after all rounds": f"{r['caught_up']:.3f}"}
            for r in sorted(results, key=lambda r: r["bytes"])]
    command = "nice -n 10 .venv/bin/python benchmarks/codec_energy.py" + "".join(f" {shlex.quote(a)}" for a in argv)
    report = "\n".join([
        "### What a codec keeps per byte (issue 18)", "",
        f"Pseudo-gradients of one replica of the tiny model ({parameters:,} parameters) trained "
        f"alone, {args.rounds} rounds of H = {args.inner_steps} steps of {args.micro_batch}×"
        f"{args.seq_len} tokens; every codec compresses the same sequence with error feedback. "
        "kept: 1 − ‖x − D(C(x))‖²/‖x‖² for the round's target x = Δ + e (mean over rounds); caught "
        f"up: 1 − ‖e‖²/‖ΣΔ‖² after the last round. {seconds / 60:.1f} min.", "",
        markdown_table(rows), "", "Command:", "", f"    {command}"])
    print(report)
    if not args.no_results:
        write_block(HERE / "NOTEBOOK.md", "codec-energy", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
