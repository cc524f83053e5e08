"""Tokens/s of lowcomm-node's inner trainer against a minimal plain-torch loop, in one run.

Same model, same batch shape, same threads, same data, same device and precision (bf16 autocast
and fused AdamW on CUDA, fp32 on the CPU), neither compiled. The two are run in alternating
blocks (ours then plain, plain then ours, ...) so that a slow phase of the machine hits both
alike; each block's rate is recorded and the medians are compared. On CUDA each block ends with
a device synchronisation, and the model FLOP utilisation is reported:

    MFU = tokens/s × (6·N + 12·L·d·T) / peak,

N the parameters that take part in matrix products (the input embedding is a lookup, so left
out), L layers, d width, T sequence length (the attention term of the PaLM paper's appendix B),
peak the device's dense bf16 rate (--peak-tflops; H100 and H200 SXM: 989).

    .venv/bin/python benchmarks/trainer_throughput.py --blocks 5 --steps 40 --threads 2
    python benchmarks/trainer_throughput.py --device cuda --config configs/train-tiny.toml \\
        --set model.preset=small ... --json out.json        # see benchmarks/gpu_check.sh
"""

from __future__ import annotations

import argparse
import contextlib
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
from node.train.trainer import InnerTrainer, pick_device  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, SXM parts


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(cfg, corpus, device, steps_per_block: int, blocks: list[float]):
    """The baseline a user would write: sample, forward, backward, AdamW step. Nothing else."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.model.vocab_size or corpus.vocab_size, device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=cuda or None)
    rng = np.random.default_rng(0)
    seq, batch = cfg.data.seq_len, cfg.train.micro_batch_size
    window = np.arange(seq + 1)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda \
        else contextlib.nullcontext

    def run_block():
        synchronize(device)
        started = time.perf_counter()
        for _ in range(steps_per_block):
            starts = rng.integers(0, len(corpus.train) - seq - 1, size=batch)
            chunk = torch.from_numpy(corpus.train[starts[:, None] + window].astype(np.int64))
            chunk = chunk.to(device)
            with autocast():
                loss = model.loss(chunk[:, :-1], chunk[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        synchronize(device)
        blocks.append(steps_per_block * batch * seq / (time.perf_counter() - started))
    return run_block


def ours(cfg, corpus, device, steps_per_block: int, blocks: list[float]):
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
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    # one micro-batch per step, as in the plain loop
    cfg.train.tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len
    device = pick_device(args.device)
    corpus = load_corpus(cfg.data)
    rates = {"lowcomm-node InnerTrainer": [], "plain torch loop": []}
    ours_block, trainer = ours(cfg, corpus, device, args.steps, rates["lowcomm-node InnerTrainer"])
    runners = [ours_block, plain_loop(cfg, corpus, device, args.steps, rates["plain torch loop"])]
    for run in runners:  # warm-up block each, not recorded
        run()
    for values in rates.values():
        values.clear()
    for block in range(args.blocks):
        # alternate which loop goes first, so neither always inherits the other's cache state
        for run in (runners if block % 2 == 0 else runners[::-1]):
            run()
    ours_rate = statistics.median(rates["lowcomm-node InnerTrainer"])
    plain_rate = statistics.median(rates["plain torch loop"])
    paired = statistics.median(o / p for o, p in zip(rates["lowcomm-node InnerTrainer"],
                                                       rates["plain torch loop"]))
    per_token, peak = flops_per_token(cfg, trainer.model), peak_flops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model {cfg.model.preset} ({count_parameters(trainer.model):,} parameters), batch "
          f"{cfg.train.micro_batch_size}x{cfg.data.seq_len}, device {name}, threads "
          f"{args.threads}, {args.blocks} blocks of {args.steps} steps")
    print("| loop | median tokens/s | MFU | blocks (tokens/s) |")
    print("|---|---|---|---|")
    mfu = {}
    for loop, values in rates.items():
        rate = statistics.median(values)
        mfu[loop] = rate * per_token / peak if peak else None
        shown = f"{mfu[loop]:.1%}" if peak else "n/a"
        print(f"| {loop} | {rate:,.0f} | {shown} | {', '.join(f'{v:,.0f}' for v in values)} |")
    print(f"ratio of medians ours / plain = {ours_rate / plain_rate:.3f}; "
          f"median of per-block ratios = {paired:.3f}; {per_token / 1e9:.3f} GFLOP a token")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "device": name, "model": cfg.model.preset,
            "parameters": count_parameters(trainer.model), "batch": cfg.train.micro_batch_size,
            "seq_len": cfg.data.seq_len, "flops_per_token": per_token,
            "peak_flops": peak, "blocks": rates, "median": {"ours": ours_rate, "plain": plain_rate},
            "mfu": mfu, "ratio_of_medians": ours_rate / plain_rate,
            "median_of_block_ratios": paired,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
            if device.type == "cuda" else None}, indent=2))


if __name__ == "__main__":
    main()
