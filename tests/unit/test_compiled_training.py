"""train.compile = on trains the same model as eager, up to rounding (torch.compile runs on this
CPU through inductor's C++ backend; on CUDA it is the default)."""

import time

import pytest
import torch

from node.config.schema import load_config
from node.data.corpus import load_corpus
from node.train.trainer import InnerTrainer

STEPS = 20
TINY = ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "model.ffn_hidden=64",
        "data.seq_len=16", "train.micro_batch_size=4", "train.tokens_per_step=64",
        f"train.steps={STEPS}", "train.warmup_steps=2", "train.lr=1e-2"]


def losses(corpus, compile_setting: str) -> tuple[list[float], InnerTrainer]:
    cfg = load_config(overrides=[*TINY, f"train.compile={compile_setting}"])
    trainer = InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len, 1, torch.device("cpu"))
    return [trainer.train_step().loss for _ in range(STEPS)], trainer


def test_compiled_losses_equal_eager_ones_within_rounding_over_20_steps():
    corpus = load_corpus(load_config().data)
    eager, _ = losses(corpus, "off")
    started = time.perf_counter()
    compiled, trainer = losses(corpus, "on")
    assert trainer.loss_fn.mode == "compiled", trainer.loss_fn.describe()  # not a silent eager
    print(f"compiled: {STEPS} steps in {time.perf_counter() - started:.1f} s, compilation included")
    # A step's loss sums 64 per-token terms whose kernels compilation fuses and reorders: each
    # step may differ by up to 64 roundings, and the weights that the next steps start from
    # carry the earlier steps' differences: at most STEPS times that after STEPS steps.
    bound = STEPS * 64 * torch.finfo(torch.float32).eps
    for step, (a, b) in enumerate(zip(eager, compiled)):
        assert b == pytest.approx(a, rel=bound, abs=0), f"step {step}"
    assert eager[-1] < eager[0] - 1.0  # it trained: the comparison is of a moving model
