"""Convergence in simulation (issue 3): every method on the same replicas, data and token budget.

Main comparison (tiny model, embedded stdlib corpus, 8 replicas, equal tokens per replica, same
seeds and batch streams): data-parallel, DiLoCo (H=100, the NoLoCo paper's baseline μ=0.3),
NoLoCo (H=50, blocking and overlap), DiLoCoX (H=100, low-rank + 8-bit, delay 1) and local-only.
Writes benchmarks/convergence.{png,json} and its block of benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/convergence.py
    .venv/bin/python benchmarks/convergence.py --scale   # NoLoCo and DiLoCoX, 64 replicas of a
                                                         # smaller model: spread of the weights
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from node.config import load_config
from node.data import load_corpus
from node.simulator import SimulationSettings, run_simulation
from node.simulator.report import human_bytes, markdown_table, plot_validation_loss, write_json

HERE = Path(__file__).resolve().parent
SECTION = "## Convergence in simulation (issue 3)"
SCALE_MODEL = ["model.dim=32", "model.n_heads=2", "model.n_layers=2", "model.ffn_hidden=96"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", action="store_true", help="the 64-replica run instead of the main one")
    p.add_argument("--workers", type=int, help="replicas (default 8, or 64 with --scale)")
    p.add_argument("--steps", type=int, help="inner steps per replica, a multiple of 100 "
                   "(default 800, or 400 with --scale)")
    p.add_argument("--seq-len", type=int, help="default 128 (64 with --scale)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--lr", type=float, help="inner peak learning rate, one for all methods "
                   "(default 3e-3, or 1e-2 with --scale)")
    p.add_argument("--warmup", type=int, default=40, help="inner warm-up steps (default 40)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo/DiLoCoX η (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.3,
                   help="DiLoCo/DiLoCoX μ (default 0.3: the NoLoCo paper's DiLoCo baseline)")
    p.add_argument("--rank", type=int, default=4, help="DiLoCoX low-rank rank (default 4)")
    p.add_argument("--bits", type=int, default=8, choices=(4, 8), help="DiLoCoX bits (default 8)")
    p.add_argument("--methods", help="comma-separated subset of the method keys, for pilots")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra node-config override (repeatable)")
    p.add_argument("--out-dir", type=Path, default=HERE, help="where the PNG and JSON go")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--no-results", action="store_true", help="do not touch RESULTS.md (pilots)")
    args = p.parse_args(argv)
    defaults = {"workers": (8, 64), "steps": (800, 400), "seq_len": (128, 64), "lr": (3e-3, 1e-2)}
    for name, (main, scale) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, scale if args.scale else main)
    if args.steps % 100:
        p.error(f"--steps {args.steps} must be a multiple of 100 (H = 100 and H = 50 rounds).")
    return args


def method_settings(args: argparse.Namespace) -> dict[str, SimulationSettings]:
    """The methods, by key. Rounds follow from equal steps; seeds are the same everywhere."""
    common = {"workers": args.workers, "seed": args.seed}
    outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    dilocox = {"codec": "lowrank", "rank": args.rank, "bits": args.bits, "delay": 1, **outer}
    if args.scale:
        return {
            "noloco-overlap": SimulationSettings("noloco", inner_steps=50, rounds=args.steps // 50,
                                                 timing="overlap", **common),
            # H = 50 here too: the spread is read round by round, and 64 replicas leave
            # time for few rounds on 2 cores.
            "dilocox": SimulationSettings("dilocox", inner_steps=50, rounds=args.steps // 50,
                                          **dilocox, **common),
        }
    every_50 = args.steps // 50
    return {
        "data-parallel": SimulationSettings("data-parallel", inner_steps=50, rounds=every_50, **common),
        "diloco": SimulationSettings("diloco", inner_steps=100, rounds=args.steps // 100, **outer, **common),
        "noloco-blocking": SimulationSettings("noloco", inner_steps=50, rounds=every_50,
                                              timing="blocking", **common),
        "noloco-overlap": SimulationSettings("noloco", inner_steps=50, rounds=every_50,
                                             timing="overlap", **common),
        "dilocox": SimulationSettings("dilocox", inner_steps=100, rounds=args.steps // 100,
                                      **dilocox, **common),
        "local": SimulationSettings("local", inner_steps=50, rounds=every_50, **common),
    }


def node_config(args: argparse.Namespace):
    overrides = [f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.tokens_per_step={args.micro_batch * args.seq_len}", f"train.lr={args.lr}",
                 f"train.warmup_steps={args.warmup}", f"train.eval_batches={args.eval_batches}",
                 f"train.threads={args.threads}", "train.device=\"cpu\"",
                 *(SCALE_MODEL if args.scale else ["model.preset=\"tiny\""]), *args.overrides]
    return load_config(None, overrides)


def relative(value: float, reference: float) -> str:
    return f"{100 * (value - reference) / reference:+.2f}%"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def main_report(results: dict, args, command: str, seconds: float) -> str:
    """The markdown block of the main comparison: scale, table, targets."""
    first = next(iter(results.values()))
    cfg = first.config
    diloco = results.get("diloco")
    rows = []
    for key, r in results.items():
        row = {"method": r.method, "final val loss (mean)": f"{r.final_val_loss:.4f}",
               "best / worst replica": f"{r.final.val_loss_min:.4f} / {r.final.val_loss_max:.4f}",
               "vs DiLoCo": relative(r.final_val_loss, diloco.final_val_loss) if diloco else "-",
               "sent per replica": human_bytes(r.final.bytes_sent_per_replica),
               "DiLoCo bytes / these": (f"{diloco.final.bytes_sent_per_replica / r.final.bytes_sent_per_replica:.1f}x"
                                        if diloco and r.final.bytes_sent_per_replica else "-"),
               "weight spread": f"{r.final.weight_spread:.1e}",
               "wall": f"{r.final.wall_seconds / 60:.1f} min"}
        rows.append(row)
    tokens = first.final.tokens_per_replica
    lines = [
        f"Scale: {args.workers} replicas of the tiny model ({first.parameters:,} parameters), "
        f"{args.steps} inner steps of {args.micro_batch}×{cfg['data']['seq_len']} tokens each = "
        f"{tokens:,} tokens per replica ({tokens * args.workers:,} in all) per method; inner AdamW "
        f"peak lr {cfg['train']['lr']:g} (one value for all methods), warm-up "
        f"{cfg['train']['warmup_steps']}, cosine to 0.1× over the run; validation on "
        f"{cfg['train']['eval_batches']}×{args.micro_batch} fixed sequences; "
        f"{args.threads} torch thread(s) on a shared 2-core machine; whole run {seconds / 60:.0f} min.",
        f"Outer settings: DiLoCo and DiLoCoX η = {args.outer_lr}, μ = {args.outer_momentum} (Nesterov); "
        "NoLoCo α = 0.5, β = γ = 0.7, snapshots in bf16; DiLoCoX low-rank rank "
        f"{args.rank}, {args.bits}-bit factors, 8-bit blockwise for small tensors, delay 1, group = "
        "all replicas. Bytes are the codecs' exact encoded sizes (no wire headers); DiLoCo and "
        "data-parallel are counted as a ring all-reduce of fp32.",
        "", markdown_table(rows), "", "![convergence](convergence.png)", "", "Targets:"]
    lines += targets(results)
    lines += ["", "Command:", "", f"    {command}"]
    return "\n".join(lines)


def targets(results: dict) -> list[str]:
    out = []
    diloco, local, dilocox = results.get("diloco"), results.get("local"), results.get("dilocox")
    if diloco:
        for key in ("noloco-blocking", "noloco-overlap"):
            if key in results:
                gap = (results[key].final_val_loss - diloco.final_val_loss) / diloco.final_val_loss
                out.append(f"- {results[key].method} within 2% of DiLoCo's final loss: "
                           f"{100 * gap:+.2f}%, {verdict(gap <= 0.02)}.")
        if dilocox:
            ratio = diloco.final.bytes_sent_per_replica / dilocox.final.bytes_sent_per_replica
            gap = (dilocox.final_val_loss - diloco.final_val_loss) / diloco.final_val_loss
            out.append(f"- DiLoCoX sends ≥ 50× fewer bytes than DiLoCo fp32: {ratio:.1f}×, "
                       f"{verdict(ratio >= 50)}; ends within 2% of DiLoCo's loss: "
                       f"{100 * gap:+.2f}%, {verdict(gap <= 0.02)}.")
    if local:
        for key, r in results.items():
            if key != "local":
                gap = (r.final_val_loss - local.final_val_loss) / local.final_val_loss
                out.append(f"- {r.method} below local-only (criterion: at least 1% lower): "
                           f"{100 * gap:+.2f}%, {verdict(gap <= -0.01)}.")
    return out


def scale_report(results: dict, args, command: str, seconds: float) -> str:
    first = next(iter(results.values()))
    lines = [f"### Scale: {args.workers} replicas of a {first.parameters:,}-parameter model "
             f"(dim 32, 2 layers), {args.steps} steps of {args.micro_batch}×{args.seq_len} tokens, "
             f"{seconds / 60:.1f} min", ""]
    for r in results.values():
        spreads = ", ".join(f"{x.weight_spread:.1e}" for x in r.records)
        lrs = ", ".join(f"{x.lr:.1e}" for x in r.records)
        lines += [f"- {r.method}: final val loss {r.final_val_loss:.4f} (replicas "
                  f"{r.final.val_loss_min:.4f} to {r.final.val_loss_max:.4f}), sent "
                  f"{human_bytes(r.final.bytes_sent_per_replica)} per replica, "
                  f"{r.final.local_updates} local updates, {r.final.resyncs} resyncs.",
                  f"  weight spread by round: {spreads}", f"  inner lr at round end: {lrs}"]
    noloco = results.get("noloco-overlap")
    if noloco:
        spreads = [x.weight_spread for x in noloco.records]
        peak = max(spreads)
        shrinks = spreads[-1] < peak
        lines.append(f"- NoLoCo spread stays bounded (peak {peak:.1e}) and ends below its peak "
                     f"as the lr decays ({spreads[-1]:.1e}): {verdict(shrinks)}.")
    lines += ["", "![scale](convergence_scale.png)", "", "Command:", "", f"    {command}"]
    return "\n".join(lines)


def write_block(results_md: Path, block: str, text: str) -> None:
    """Replace this benchmark's block (between its markers) in RESULTS.md, adding the section
    and the block if absent; everything else in the file is left as it is."""
    start, end = f"<!-- convergence:{block}:start -->", f"<!-- convergence:{block}:end -->"
    content = results_md.read_text(encoding="utf-8") if results_md.exists() else "# Benchmark results\n"
    if start in content and end in content:
        head, rest = content.split(start, 1)
        content = head + start + "\n" + text + "\n" + end + rest.split(end, 1)[1]
    else:
        if SECTION not in content:
            content = content.rstrip("\n") + f"\n\n{SECTION}\n"
        head, tail = content.split(SECTION, 1)
        cut = tail.find("\n## ")  # the end of this section: the next section, if any
        section, after = (tail, "") if cut < 0 else (tail[:cut + 1], tail[cut + 1:])
        section = section.rstrip("\n") + f"\n\n{start}\n{text}\n{end}\n"
        content = head + SECTION + section + ("\n" + after if after else "")
    results_md.write_text(content, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = ".venv/bin/python benchmarks/convergence.py" + "".join(f" {shlex.quote(a)}" for a in argv)
    torch.manual_seed(args.seed)
    config = node_config(args)
    corpus = load_corpus(config.data)
    settings = method_settings(args)
    if args.methods:
        unknown = sorted(set(args.methods.split(",")) - set(settings))
        if unknown:
            raise SystemExit(f"unknown method {unknown[0]!r}: choose from {', '.join(settings)}.")
        settings = {k: v for k, v in settings.items() if k in args.methods.split(",")}
    started = time.perf_counter()
    results = {}
    for key, s in settings.items():
        print(f"[{time.perf_counter() - started:6.0f}s] {s.describe()}: {s.workers} replicas, "
              f"{s.rounds} rounds", flush=True)
        results[key] = run_simulation(s, config, corpus, on_round=lambda r: print(
            f"    round {r.round}: val {r.val_loss_mean if r.val_loss_mean is None else round(r.val_loss_mean, 4)}"
            f" spread {r.weight_spread:.1e} sent {human_bytes(r.bytes_sent_per_replica)}"
            f" ({r.wall_seconds:.0f}s)", flush=True))
    seconds = time.perf_counter() - started
    name = "convergence_scale" if args.scale else "convergence"
    write_json(list(results.values()), args.out_dir / f"{name}.json")
    plot_validation_loss(list(results.values()), args.out_dir / f"{name}.png",
                         f"{args.workers} replicas, equal tokens per replica", with_spread=args.scale)
    report = (scale_report if args.scale else main_report)(results, args, command, seconds)
    print(report)
    if not args.no_results:
        write_block(args.results, "scale" if args.scale else "main", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
