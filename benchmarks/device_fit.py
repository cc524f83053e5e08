"""The micro-batch the trainer's probe finds on this device, its memory, and its speed there.

Builds the InnerTrainer with train.micro_batch_probe = on (node/train/accelerator.py): the probe
tries the even splits of a step's sequences, largest first, until one fits with its headroom.
Reported: the size found, the probe's peak memory at that size, the probe's seconds, then
--steps steps at that size (tokens/s, the peak memory of training with the optimizer's state)
in the device's precision, compiled or not (--compile).

    python benchmarks/device_fit.py --device cuda --config configs/train-tiny.toml \\
        --set model.preset=small ... --set train.tokens_per_step=131072 --json fit.json
    .venv/bin/python benchmarks/device_fit.py --steps 2 --set model.dim=32 --set model.n_layers=1 \\
        --set model.n_heads=2 --set model.ffn_hidden=64 --set data.seq_len=16   # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.config.schema import load_config  # noqa: E402
from node.data.corpus import load_corpus, stream_seed  # noqa: E402
from node.train.trainer import InnerTrainer, pick_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/train-tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--compile", default="off", choices=("auto", "on", "off"))
    parser.add_argument("--steps", type=int, default=5, help="steps at the size found")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    cfg.train.micro_batch_probe, cfg.train.compile = "on", args.compile
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    corpus = load_corpus(cfg.data)
    started = time.perf_counter()
    trainer = InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len,
                           stream_seed(b"benchmark", 0), device)
    probe_s = time.perf_counter() - started  # building the model included
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train_step()  # compiles, if it does
    if cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    tokens = sum(trainer.train_step().tokens for _ in range(args.steps))
    if cuda:
        torch.cuda.synchronize(device)
    rate = tokens / (time.perf_counter() - started)
    use = trainer.device_use()
    result = {
        "command": " ".join(sys.argv), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "model": cfg.model.preset, "seq_len": cfg.data.seq_len,
        "sequences_per_step": trainer.rows, "micro_batch": trainer.fit.size,
        "micro_batch_after_training": trainer.micro_batch, "probe_reason": trainer.fit.reason,
        "probe_peak_bytes": trainer.fit.peak_bytes, "probe_seconds": probe_s,
        "training_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "tokens_per_second": rate, "precision": use.precision, "compute": use.compute}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
