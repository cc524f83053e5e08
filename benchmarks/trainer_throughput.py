"""Tokens/s of lowcomm-node's inner trainer against a minimal plain-torch loop, in one run.

Same model, same batch shape, same threads, same data, same device and precision (the trainer's
choice for the device, node/train/accelerator.py, or --precision: bf16 or loss-scaled fp16
autocast and fused AdamW on CUDA, fp32 on the CPU). --loops picks the loops: ours (the
InnerTrainer, train.compile = off), ours-compiled (train.compile = on), plain, plain-compiled
(the plain loop's loss through torch.compile). They are run in rotating blocks (a slow phase of
the machine hits all alike), after one warm-up block each that also compiles; each block's rate
is recorded and the medians are compared with the last loop's. On CUDA each block ends with a
device synchronisation, and the model FLOP utilisation is reported:

    MFU = tokens/s × (6·N + 12·L·d·T) / peak,

N the parameters that take part in matrix products (the input embedding is a lookup, so left
out), L layers, d width, T sequence length (the attention term of the PaLM paper's appendix B),
peak the device's dense bf16 rate (--peak-tflops; H100 and H200 SXM: 989).

    .venv/bin/python benchmarks/trainer_throughput.py --blocks 5 --steps 40 --threads 2
    .venv/bin/python benchmarks/trainer_throughput.py --blocks 1 --steps 2 --set model.dim=32 \
        --set model.n_layers=1 --set model.n_heads=2 --set model.ffn_hidden=64 \
        --set data.seq_len=16 --loops ours,ours-compiled,plain-compiled   # a CPU dry run
    python benchmarks/trainer_throughput.py --device cuda --config configs/train-tiny.toml \\
        --set model.preset=small ... --json out.json        # see benchmarks/gpu_check.sh
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.config.schema import load_config  # noqa: E402
from node.data.corpus import load_corpus, stream_seed  # noqa: E402
from node.train.model import build_model, count_parameters  # noqa: E402
from node.train.accelerator import autocast, device_precision  # noqa: E402
from node.train.trainer import InnerTrainer, pick_device  # noqa: E402

LOOPS = ("ours", "ours-compiled", "plain", "plain-compiled")

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, SXM parts


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(cfg, corpus, device, steps_per_block: int, blocks: list[float], compiled: bool):
    """The baseline a user would write: sample, forward, backward, AdamW step (loss-scaled in
    fp16). Nothing else."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.model.vocab_size or corpus.vocab_size, device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=cuda or None)
    rng = np.random.default_rng(0)
    seq, batch = cfg.data.seq_len, cfg.train.micro_batch_size
    window = np.arange(seq + 1)
    precision = device_precision(device, cfg.train.precision)
    scaler = torch.amp.GradScaler(device.type) if precision.loss_scaling else None
    loss_fn = torch.compile(model.loss) if compiled else model.loss

    def run_block():
        synchronize(device)
        started = time.perf_counter()
        for _ in range(steps_per_block):
            starts = rng.integers(0, len(corpus.train) - seq - 1, size=batch)
            chunk = torch.from_numpy(corpus.train[starts[:, None] + window].astype(np.int64))
            chunk = chunk.to(device)
            with autocast(device, precision):
                loss = loss_fn(chunk[:, :-1], chunk[:, 1:])
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
        synchronize(device)
        blocks.append(steps_per_block * batch * seq / (time.perf_counter() - started))
    return run_block


def ours(cfg, corpus, device, steps_per_block: int, blocks: list[float], compiled: bool):
    cfg.train.compile, cfg.train.micro_batch_probe = ("on" if compiled else "off"), "off"
    trainer = InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len,
                           stream_seed(b"benchmark", 0), device)

    def run_block():
        synchronize(device)
        started = time.perf_counter()
        tokens = sum(trainer.train_step().tokens for _ in range(steps_per_block))
        synchronize(device)
        blocks.append(tokens / (time.perf_counter() - started))
    return run_block, trainer


def flops_per_token(cfg, model: torch.nn.Module) -> float:
    matmul_params = count_parameters(model) - model.embed.weight.numel() \
        * (0 if cfg.model.tie_embeddings else 1)
    return 6 * matmul_params + 12 * cfg.model.n_layers * cfg.model.dim * cfg.data.seq_len


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", default="configs/train-tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="a config value, e.g. model.dim=768")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                        help="train.precision of every loop (auto: the trainer's choice)")
    parser.add_argument("--loops", default="ours,plain",
                        help=f"comma-separated, of {', '.join(LOOPS)}; the last is the reference")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    loops = args.loops.split(",")
    if not loops or set(loops) - set(LOOPS):
        parser.error(f"--loops {args.loops!r}: choose from {', '.join(LOOPS)}")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    # one micro-batch per step, as in the plain loop
    cfg.train.tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len
    cfg.train.precision = args.precision
    device = pick_device(args.device)
    corpus = load_corpus(cfg.data)
    rates: dict[str, list[float]] = {loop: [] for loop in loops}
    runners, compile_seconds, trainer, use = [], {}, None, None
    for loop in loops:
        compiled = loop.endswith("-compiled")
        if loop.startswith("ours"):
            run, trainer = ours(copy.deepcopy(cfg), corpus, device, args.steps, rates[loop], compiled)
            use = trainer.device_use()
        else:
            run = plain_loop(cfg, corpus, device, args.steps, rates[loop], compiled)
        started = time.perf_counter()
        run()  # the warm-up block, not recorded: compilation happens here
        compile_seconds[loop] = time.perf_counter() - started
        if trainer is not None and loop.startswith("ours"):
            use = trainer.device_use()  # after the first steps: compiled, or fallen back
        runners.append(run)
    for values in rates.values():
        values.clear()
    for block in range(args.blocks):
        # rotate which loop goes first, so none always inherits another's cache state
        shift = block % len(runners)
        for run in runners[shift:] + runners[:shift]:
            run()
    reference = loops[-1]
    medians = {loop: statistics.median(values) for loop, values in rates.items()}
    model = trainer.model if trainer else build_model(cfg.model, cfg.model.vocab_size or corpus.vocab_size)
    per_token, peak = flops_per_token(cfg, model), peak_flops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    precision = device_precision(device, cfg.train.precision).describe()
    print(f"model {cfg.model.preset} ({count_parameters(model):,} parameters), batch "
          f"{cfg.train.micro_batch_size}x{cfg.data.seq_len}, device {name}, {precision}, threads "
          f"{args.threads}, {args.blocks} blocks of {args.steps} steps")
    print(f"| loop | median tokens/s | MFU | / {reference} | warm-up block s | blocks (tokens/s) |")
    print("|---|---|---|---|---|---|")
    mfu = {}
    for loop, values in rates.items():
        mfu[loop] = medians[loop] * per_token / peak if peak else None
        shown = f"{mfu[loop]:.1%}" if peak else "n/a"
        print(f"| {loop} | {medians[loop]:,.0f} | {shown} | {medians[loop] / medians[reference]:.3f} | "
              f"{compile_seconds[loop]:.1f} | {', '.join(f'{v:,.0f}' for v in values)} |")
    if use:
        print(f"ours: {use.compute}; {per_token / 1e9:.3f} GFLOP a token")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "device": name, "model": cfg.model.preset,
            "precision": precision, "ours_compute": use.compute if use else None,
            "parameters": count_parameters(model), "batch": cfg.train.micro_batch_size,
            "seq_len": cfg.data.seq_len, "flops_per_token": per_token,
            "peak_flops": peak, "blocks": rates, "median": medians, "mfu": mfu,
            "reference": reference, "ratio_to_reference": {
                loop: medians[loop] / medians[reference] for loop in loops},
            "warmup_block_seconds": compile_seconds,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
            if device.type == "cuda" else None}, indent=2))


if __name__ == "__main__":
    main()
