"""Tokens/s of lowcomm-node's inner trainer against a minimal plain-torch loop, in one run.

Same model, same batch shape, same threads, same data. The two are run in alternating blocks
(ours then plain, plain then ours, ...) so that a slow phase of the machine hits both alike; each
block's rate is recorded and the medians are compared.

    .venv/bin/python benchmarks/trainer_throughput.py --blocks 5 --steps 40 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from node.config.schema import load_config
from node.data.corpus import load_corpus, stream_seed
from node.train.model import build_model
from node.train.trainer import InnerTrainer


def plain_loop(cfg, corpus, steps_per_block: int, blocks: list[float]):
    """The baseline a user would write: sample, forward, backward, AdamW step. Nothing else."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, corpus.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    rng = np.random.default_rng(0)
    seq, batch = cfg.data.seq_len, cfg.train.micro_batch_size
    window = np.arange(seq + 1)

    def run_block():
        started = time.perf_counter()
        for _ in range(steps_per_block):
            starts = rng.integers(0, len(corpus.train) - seq - 1, size=batch)
            chunk = torch.from_numpy(corpus.train[starts[:, None] + window].astype(np.int64))
            loss = model.loss(chunk[:, :-1], chunk[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        blocks.append(steps_per_block * batch * seq / (time.perf_counter() - started))
    return run_block


def ours(cfg, corpus, steps_per_block: int, blocks: list[float]):
    trainer = InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len,
                           stream_seed(b"benchmark", 0), torch.device("cpu"))

    def run_block():
        started = time.perf_counter()
        tokens = sum(trainer.train_step().tokens for _ in range(steps_per_block))
        blocks.append(tokens / (time.perf_counter() - started))
    return run_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", default="configs/train-tiny.toml")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    # one micro-batch per step, as in the plain loop
    cfg.train.tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len
    corpus = load_corpus(cfg.data)
    rates = {"lowcomm-node InnerTrainer": [], "plain torch loop": []}
    runners = [ours(cfg, corpus, args.steps, rates["lowcomm-node InnerTrainer"]),
               plain_loop(cfg, corpus, args.steps, rates["plain torch loop"])]
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
    print(f"model {cfg.model.preset}, batch {cfg.train.micro_batch_size}x{cfg.data.seq_len}, "
          f"threads {args.threads}, {args.blocks} blocks of {args.steps} steps")
    print("| loop | median tokens/s | blocks (tokens/s) |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):,.0f} | "
              f"{', '.join(f'{v:,.0f}' for v in values)} |")
    print(f"ratio of medians ours / plain = {ours_rate / plain_rate:.3f}; "
          f"median of per-block ratios = {paired:.3f}")


if __name__ == "__main__":
    main()
