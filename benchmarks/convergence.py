"""Convergence in simulation (issue 3): every method on the same replicas, data and token budget.

Main comparison (tiny model, embedded stdlib corpus, 8 replicas, equal tokens per replica, same
seeds and batch streams): data-parallel, DiLoCo (H=100, the NoLoCo paper's baseline μ=0.3),
NoLoCo (H=50, blocking and overlap, and overlap with a swap that takes 10 of the 50 steps),
DiLoCoX (H=100, low-rank + 8-bit, delay 1) and local-only.
Writes benchmarks/convergence.{png,json} and its block of benchmarks/NOTEBOOK.md.

    .venv/bin/python benchmarks/convergence.py
    .venv/bin/python benchmarks/convergence.py --scale   # NoLoCo and DiLoCoX, 64 replicas of a
                                                         # smaller model: spread of the weights
    .venv/bin/python benchmarks/convergence.py --diagnostics  # where DiLoCoX's loss goes:
                                                         # delay and compression one at a time
    .venv/bin/python benchmarks/convergence.py --lr-sweep 5e-4,1e-3,2e-3  # the inner lr, tuned
                                                         # once (one replica, local, same budget)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from node.config.manifest import WIRE_DTYPE_CHOICES
from node.config.schema import load_config
from node.data.corpus import load_corpus
from node.simulator import SimulationSettings, run_simulation
from node.simulator.report import human_bytes, markdown_table, plot_validation_loss, write_json

HERE = Path(__file__).resolve().parent
SECTION = "## Convergence in simulation (issue 3)"
SCALE_MODEL = ["model.dim=32", "model.n_heads=2", "model.n_layers=2", "model.ffn_hidden=96"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--scale", action="store_true", help="the 64-replica run instead of the main one")
    mode.add_argument("--diagnostics", action="store_true", help="DiLoCo and DiLoCoX with its delay "
                      "and its compression separately, instead of the main run")
    mode.add_argument("--lr-sweep", metavar="LRS", help="comma-separated inner lrs: local training "
                      "of one replica on the same budget, to pick --lr once for all methods")
    p.add_argument("--workers", type=int, help="replicas (default 8, or 64 with --scale)")
    p.add_argument("--steps", type=int, help="inner steps per replica, a multiple of 100 "
                   "(default 800, or 400 with --scale)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--micro-batch", type=int, help="sequences per step (default 3, or 4 with --scale)")
    p.add_argument("--lr", type=float, help="inner peak learning rate, one for all methods "
                   "(default 1e-3, from --lr-sweep; 3e-3 with --scale)")
    p.add_argument("--warmup", type=int, default=40, help="inner warm-up steps (default 40)")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches (default 16)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo/DiLoCoX η (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.3,
                   help="DiLoCo/DiLoCoX μ (default 0.3: the NoLoCo paper's DiLoCo baseline)")
    p.add_argument("--inner-steps", type=int, default=100, help="H of DiLoCo and DiLoCoX (default 100)")
    p.add_argument("--codec", default="lowrank", choices=("lowrank", "topk", "identity"),
                   help="DiLoCoX codec (default lowrank)")
    p.add_argument("--rank", type=int, default=2, help="DiLoCoX low-rank rank (default 2: the "
                   "largest whose 8-bit messages to 7 peers cost 50x less than DiLoCo's ring)")
    p.add_argument("--bits", type=int, choices=(2, 4, 8), help="DiLoCoX bits (default: lowrank "
                   "8, topk 2)")
    p.add_argument("--delay", type=int, default=1, choices=(0, 1), help="DiLoCoX delay (default 1)")
    p.add_argument("--latency-steps", type=int, default=0, help="DiLoCoX: a message's travel time "
                   "in inner steps (default 0)")
    p.add_argument("--dilocox-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a key of DiLoCoX's manifest [protocol] section, e.g. topk_k=32 (repeatable)")
    p.add_argument("--wire-dtype", default="int4", choices=WIRE_DTYPE_CHOICES,
                   help="how NoLoCo snapshots travel (default int4, the manifest's, rounded "
                   "stochastically; int8; bf16, fp16, fp32)")
    p.add_argument("--snapshot", choices=("theta", "phi_delta"), default="theta",
                   help="what a NoLoCo snapshot sends: θ alone (default; exact as β = γ) or φ and Δ")
    p.add_argument("--methods", help="comma-separated subset of the method keys, for pilots")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared "
                   "2-core machine two threads ran slower and far more erratically than one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra node-config override (repeatable)")
    p.add_argument("--out-dir", type=Path, default=HERE, help="where the PNG and JSON go")
    p.add_argument("--results", type=Path, default=HERE / "NOTEBOOK.md")
    p.add_argument("--no-results", action="store_true", help="do not touch NOTEBOOK.md (pilots)")
    args = p.parse_args(argv)
    defaults = {"workers": (8, 64), "steps": (800, 400), "micro_batch": (3, 4), "lr": (1e-3, 3e-3)}
    for name, (main, scale) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, scale if args.scale else main)
    if args.lr_sweep:
        try:
            args.lr_sweep = ",".join(str(float(lr)) for lr in args.lr_sweep.split(","))
        except ValueError:
            p.error(f"--lr-sweep {args.lr_sweep!r} is not a comma-separated list of numbers.")
    if args.bits is None:
        args.bits = 2 if args.codec == "topk" else 8
    if args.steps % args.inner_steps or args.steps % 50:
        p.error(f"--steps {args.steps} must be a multiple of 50 and of H = {args.inner_steps}.")
    try:
        args.dilocox_values = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.dilocox_set)}
    except ValueError:
        p.error(f"--dilocox-set {args.dilocox_set!r}: each must be KEY=VALUE with a JSON value.")
    return args


SNAPSHOT_WORDS = {"theta": "(θ alone)", "phi_delta": "(φ and Δ)"}


def method_settings(args: argparse.Namespace) -> dict[str, SimulationSettings]:
    """The methods, by key. Rounds follow from equal steps; seeds are the same everywhere."""
    common = {"workers": args.workers, "seed": args.seed}
    noloco = {"wire_dtype": args.wire_dtype, "snapshot": args.snapshot, **common}
    outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    codec = {"lowrank": {"rank": args.rank, "bits": args.bits}, "topk": {"bits": args.bits},
             "identity": {}}[args.codec]
    dilocox = {"codec": args.codec, **codec, "delay": args.delay, "latency_steps": args.latency_steps,
               "protocol_values": args.dilocox_values, **outer}
    H = args.inner_steps
    if args.scale:
        return {
            "noloco-overlap": SimulationSettings("noloco", inner_steps=50, rounds=args.steps // 50,
                                                 timing="overlap", **noloco),
            # H = 50 here too: the spread is read round by round, and 64 replicas leave
            # time for few rounds on 2 cores.
            "dilocox": SimulationSettings("dilocox", inner_steps=50, rounds=args.steps // 50,
                                          **dilocox, **common),
        }
    every_50 = args.steps // 50
    if args.lr_sweep:
        return {f"lr={lr}": SimulationSettings("local", inner_steps=100, rounds=args.steps // 100,
                                               workers=1, seed=args.seed)
                for lr in args.lr_sweep.split(",")}
    if args.diagnostics:
        def variant(codec: dict, delay: int) -> SimulationSettings:
            return SimulationSettings("dilocox", inner_steps=H, rounds=args.steps // H,
                                      **{**dilocox, **codec, "delay": delay}, **common)
        identity = {"codec": "identity", "rank": None, "bits": None}
        return {
            "diloco": SimulationSettings("diloco", inner_steps=H, rounds=args.steps // H, **outer, **common),
            "dilocox-identity-delay1": variant(identity, 1),
            "dilocox-lowrank-delay0": variant({}, 0),
            "dilocox": variant({}, 1),
        }
    return {
        "data-parallel": SimulationSettings("data-parallel", inner_steps=50, rounds=every_50, **common),
        "diloco": SimulationSettings("diloco", inner_steps=H, rounds=args.steps // H, **outer, **common),
        "noloco-blocking": SimulationSettings("noloco", inner_steps=50, rounds=every_50,
                                              timing="blocking", **noloco),
        "noloco-overlap": SimulationSettings("noloco", inner_steps=50, rounds=every_50,
                                             timing="overlap", **noloco),
        # the same with a swap that takes a fifth of a round: the correction lands at step 10
        "noloco-overlap-slow-swap": SimulationSettings("noloco", inner_steps=50, rounds=every_50,
                                                       timing="overlap", latency_steps=10, **noloco),
        "dilocox": SimulationSettings("dilocox", inner_steps=H, rounds=args.steps // H,
                                      **dilocox, **common),
        "local": SimulationSettings("local", inner_steps=50, rounds=every_50, **common),
    }


def node_config(args: argparse.Namespace, lr: float | None = None):
    overrides = [f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.tokens_per_step={args.micro_batch * args.seq_len}",
                 f"train.lr={args.lr if lr is None else lr}",
                 f"train.warmup_steps={args.warmup}", f"train.eval_batches={args.eval_batches}",
                 f"train.threads={args.threads}", "train.device=\"cpu\"",
                 *(SCALE_MODEL if args.scale else ["model.preset=\"tiny\""]), *args.overrides]
    return load_config(None, overrides)


def relative(value: float, reference: float) -> str:
    return f"{100 * (value - reference) / reference:+.2f}%"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def comparison_table(results: dict) -> str:
    """Final numbers of every method, relative to DiLoCo where it ran."""
    diloco = results.get("diloco")
    rows = []
    for r in results.values():
        energy = r.final.energy_kept if r.final.energy_kept is not None else \
            next((x.energy_kept for x in reversed(r.records) if x.energy_kept is not None), None)
        rows.append({
            "method": r.method, "final val loss (mean)": f"{r.final_val_loss:.4f}",
            "best / worst replica": f"{r.final.val_loss_min:.4f} / {r.final.val_loss_max:.4f}",
            "vs DiLoCo": relative(r.final_val_loss, diloco.final_val_loss) if diloco else "-",
            "sent per replica": human_bytes(r.final.bytes_sent_per_replica),
            "DiLoCo bytes / these": (f"{diloco.final.bytes_sent_per_replica / r.final.bytes_sent_per_replica:.3g}x"
                                     if diloco and r.final.bytes_sent_per_replica else "-"),
            "weight spread": f"{r.final.weight_spread:.1e}",
            "low-rank energy kept": f"{energy:.2f}" if energy is not None else "-",
            "wall": f"{r.final.wall_seconds / 60:.1f} min"})
    return markdown_table(rows)


def scale_line(results: dict, args, seconds: float) -> str:
    first = next(iter(results.values()))
    cfg = first.config
    tokens = first.final.tokens_per_replica
    model = cfg["model"]
    return (f"Scale: {args.workers} replicas of a {first.parameters:,}-parameter model (dim "
            f"{model['dim']}, {model['n_layers']} layers), {args.steps} inner steps of "
            f"{args.micro_batch}×{cfg['data']['seq_len']} tokens = {tokens:,} tokens per replica "
            f"({tokens * args.workers:,} in all) per method; inner AdamW peak lr {cfg['train']['lr']:g} "
            f"(one value for all methods), warm-up {cfg['train']['warmup_steps']}, cosine to 0.1× "
            f"over the run; validation on {cfg['train']['eval_batches']}×{args.micro_batch} fixed "
            f"sequences; {args.threads} torch thread(s) on a shared 2-core machine; whole run "
            f"{seconds / 60:.0f} min.")


def dilocox_words(args) -> str:
    """DiLoCoX's codec and the manifest keys set for it, in words."""
    codec = {"lowrank": f"low-rank rank {args.rank}, {args.bits}-bit factors, 8-bit blockwise for "
                        "small tensors",
             "topk": f"top-k with {args.bits}-bit values", "identity": "identity codec"}[args.codec]
    extra = ", ".join(f"{k} = {v}" for k, v in args.dilocox_values.items())
    latency = f", messages take {args.latency_steps} steps" if args.latency_steps else ""
    return f"{codec}{', ' + extra if extra else ''}{latency}"


def outer_line(args) -> str:
    return (f"Outer settings: DiLoCo and DiLoCoX η = {args.outer_lr}, μ = {args.outer_momentum} "
            f"(Nesterov); NoLoCo α = 0.5, β = γ = 0.7, snapshots {SNAPSHOT_WORDS[args.snapshot]} "
            f"in {args.wire_dtype}; DiLoCoX {dilocox_words(args)}, delay {args.delay}, group = all "
            "replicas. NoLoCo and DiLoCoX run the daemon's round classes (node/rounds/) over the "
            "simulator's in-memory links. Bytes are the payloads those rounds encode (no wire "
            "headers); DiLoCo and data-parallel are counted as a ring all-reduce of fp32, "
            "DiLoCoX as one message to each of the N−1 others.")


def main_report(results: dict, args, command: str, seconds: float) -> str:
    """The markdown block of the main comparison: scale, table, targets."""
    lines = [scale_line(results, args, seconds), outer_line(args), "", comparison_table(results),
             "", "![convergence](convergence.png)", "", "Targets:", *targets(results),
             "", "Command:", "", f"    {command}"]
    return "\n".join(lines)


def diagnostics_report(results: dict, args, command: str, seconds: float) -> str:
    lines = ["### Where DiLoCoX's loss goes: its delay and its compression one at a time", "",
             scale_line(results, args, seconds), outer_line(args), "", comparison_table(results),
             "", "Command:", "", f"    {command}"]
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
    model = first.config["model"]
    lines = [f"### Scale: {args.workers} replicas of a {first.parameters:,}-parameter model "
             f"(dim {model['dim']}, {model['n_layers']} layers), {args.steps} steps of "
             f"{args.micro_batch}×{args.seq_len} tokens, inner lr {first.config['train']['lr']:g}, "
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


def lr_sweep_report(results: dict, args, command: str, seconds: float) -> str:
    best = min(results, key=lambda key: results[key].final_val_loss)
    rows = [{"inner peak lr": key[3:], "final val loss": f"{r.final_val_loss:.4f}"}
            for key, r in results.items()]
    return "\n".join([
        "### Inner learning rate, tuned once for all methods", "",
        f"One replica trained alone (local) on the main run's budget ({args.steps} steps of "
        f"{args.micro_batch}×{args.seq_len} tokens, warm-up {args.warmup}, cosine to 0.1×); the "
        f"best, {best[3:]}, is the main run's --lr for every method. Whole sweep {seconds / 60:.0f} min.",
        "", markdown_table(rows), "", "Command:", "", f"    {command}"])


def write_block(results_md: Path, block: str, text: str) -> None:
    """Replace this benchmark's block (between its markers) in NOTEBOOK.md, adding the section
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
        method_config = node_config(args, lr=float(key[3:])) if args.lr_sweep else config
        results[key] = run_simulation(s, method_config, corpus, on_round=lambda r: print(
            f"    round {r.round}: val {r.val_loss_mean if r.val_loss_mean is None else round(r.val_loss_mean, 4)}"
            f" spread {r.weight_spread:.1e} sent {human_bytes(r.bytes_sent_per_replica)}"
            f" ({r.wall_seconds:.0f}s)", flush=True))
    seconds = time.perf_counter() - started
    mode = "scale" if args.scale else "diagnostics" if args.diagnostics else \
        "lr-sweep" if args.lr_sweep else "main"
    name = {"scale": "convergence_scale", "diagnostics": "convergence_diagnostics",
            "lr-sweep": "convergence_lr_sweep", "main": "convergence"}[mode]
    write_json(list(results.values()), args.out_dir / f"{name}.json")
    plot_validation_loss(list(results.values()), args.out_dir / f"{name}.png",
                         f"{args.workers} replicas, equal tokens per replica", with_spread=args.scale)
    report = {"scale": scale_report, "diagnostics": diagnostics_report, "lr-sweep": lr_sweep_report,
              "main": main_report}[mode](results, args, command, seconds)
    print(report)
    if not args.no_results:
        write_block(args.results, mode, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
