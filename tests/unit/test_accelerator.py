"""The device choices of the inner trainer: precision per card, the micro-batch that fits and
its recovery from out-of-memory, and compilation's fall-back to eager (node/train/accelerator.py)."""

import logging

import pytest
import torch

from node.config.schema import ConfigError, load_config
from node.data.corpus import load_corpus
from node.train.accelerator import (LossFunction, choose_precision, micro_batch_sizes,
                                    probe_micro_batch, smaller_micro_batch)
from node.train.trainer import InnerTrainer, pick_device

# 8 sequences of 32 tokens a step, 2 stream batches of 4
TINY = ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "model.ffn_hidden=64",
        "data.seq_len=32", "train.micro_batch_size=4", "train.tokens_per_step=256",
        "train.steps=20", "train.warmup_steps=2", "train.compile=off"]
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config().data)


def make(corpus, overrides=()):
    cfg = load_config(overrides=[*TINY, *overrides])
    return InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len, 1, torch.device("cpu"))


class FakeAllocator:
    """A fake of a small accelerator's allocator (no GPU here): a forward pre-hook on the model
    that raises torch.OutOfMemoryError when a micro-batch's sequences, plus `gradient_rows`
    once the gradients exist (their buffers take room after the first backward), are more than
    `capacity_rows`, as a card with room for that many would."""

    def __init__(self, model: torch.nn.Module, capacity_rows: int, gradient_rows: int = 0):
        self.capacity_rows, self.gradient_rows = capacity_rows, gradient_rows
        self.refused, self.sizes = 0, []
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        rows = args[0].shape[0]
        self.sizes.append(rows)
        held = self.gradient_rows if any(p.grad is not None for p in module.parameters()) else 0
        if rows + held > self.capacity_rows:
            self.refused += 1
            raise torch.OutOfMemoryError(f"fake allocator: {rows} sequences do not fit")

    def remove(self):
        self.handle.remove()


@pytest.mark.parametrize("device, capability, requested, name", [
    ("cpu", None, "auto", "fp32"),
    ("mps", None, "auto", "fp32"),
    ("cpu", None, "fp32", "fp32"),
    ("cuda", (9, 0), "auto", "bf16"),    # H100, H200
    ("cuda", (8, 9), "auto", "bf16"),    # L4, RTX 40
    ("cuda", (8, 0), "auto", "bf16"),    # A100
    ("cuda", (7, 5), "auto", "fp16"),    # T4, RTX 20
    ("cuda", (7, 0), "auto", "fp16"),    # V100
    ("cuda", (6, 1), "auto", "fp16"),    # GTX 10
    ("cuda", (9, 0), "fp16", "fp16"),    # asked for: the fp16 path on a bf16 card
    ("cuda", (9, 0), "fp32", "fp32"),
    ("cuda", (7, 5), "fp16", "fp16"),
])
def test_precision_for_each_card(device, capability, requested, name):
    choice = choose_precision(device, capability, requested)
    assert choice.name == name
    assert choice.loss_scaling == (name == "fp16")
    assert choice.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[name]
    if capability:
        assert f"{capability[0]}.{capability[1]}" in choice.describe()


@pytest.mark.parametrize("device, capability, requested, message", [
    ("cuda", (7, 5), "bf16", "needs CUDA compute capability >= 8.0, and this card has 7.5"),
    ("cpu", None, "bf16", "needs a CUDA device"),
    ("cpu", None, "fp16", "needs a CUDA device"),
])
def test_precision_that_the_device_cannot_run_is_refused(device, capability, requested, message):
    with pytest.raises(ValueError, match=message):
        choose_precision(device, capability, requested)


def test_micro_batch_sizes_split_a_step_evenly():
    assert micro_batch_sizes(12) == [12, 6, 4, 3, 2, 1]
    assert [smaller_micro_batch(m, 12) for m in (12, 6, 4, 3, 2, 1)] == [6, 3, 2, 1, 1, None]
    assert smaller_micro_batch(16, 16) == 8


def test_probe_takes_the_largest_split_that_fits_and_refuses_when_none_does():
    peaks = {8: None, 4: 900, 2: 500, 1: 300}  # 8 runs out of memory, 4 is over the limit
    fit = probe_micro_batch(peaks.get, 8, limit_bytes=600)
    assert (fit.size, fit.peak_bytes) == (2, 500) and "8 did not fit" in fit.reason
    with pytest.raises(RuntimeError, match="not even one sequence of the step fits"):
        probe_micro_batch(lambda size: None, 8, limit_bytes=None)


def test_out_of_memory_halves_the_micro_batch_and_retries_the_step_with_the_same_tokens(corpus, caplog):
    reference = make(corpus)
    reference.micro_batch = reference.rows  # unsplit: the step's 8 sequences in one pass
    trainer = make(corpus)
    # the first micro-batch of 4 fits; the second does not beside the first one's gradients
    fake = FakeAllocator(trainer.model, capacity_rows=4, gradient_rows=1)
    with caplog.at_level(logging.WARNING, logger="node.train.trainer"):
        loss = float(trainer.accumulate_gradients())
    expected = float(reference.accumulate_gradients())
    assert fake.refused == 1 and trainer.micro_batch == 2
    assert fake.sizes == [4, 4, 2, 2, 2, 2]  # a pass, the refused one, then the whole step again
    assert trainer.stream.position == reference.stream.position == 2  # no tokens skipped
    # the same 256 per-token terms summed in another order: at most 256 roundings apart
    assert loss == pytest.approx(expected, rel=256 * EPS, abs=0)
    for p, q in zip(trainer.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=256 * EPS, atol=256 * EPS * float(q.grad.abs().max()))
    sentences = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert sentences == ["out of memory at a micro-batch of 4 sequences, so step 1 runs again "
                         "with the same 256 tokens in micro-batches of 2."]
    trainer.optimizer.zero_grad(set_to_none=True)
    assert trainer.train_step().tokens == 256 and fake.refused == 1  # it stays at 2
    fake.remove()


def test_out_of_memory_at_one_sequence_is_an_error(corpus):
    trainer = make(corpus)
    FakeAllocator(trainer.model, capacity_rows=0)
    with pytest.raises(torch.OutOfMemoryError, match="at a micro-batch of one sequence"):
        trainer.train_step()


def test_probe_at_start_finds_what_the_fake_allocator_holds(corpus, caplog):
    cfg = load_config(overrides=[*TINY, "train.micro_batch_probe=on"])
    torch.manual_seed(0)
    # the hook must be on the model before the probe runs: build it through a subclass
    class Probed(InnerTrainer):
        def probe_micro_batch(self):
            self.fake = FakeAllocator(self.model, capacity_rows=3)
            return super().probe_micro_batch()

    with caplog.at_level(logging.INFO, logger="node.train.trainer"):
        trainer = Probed(cfg.model, cfg.train, corpus, cfg.data.seq_len, 1, torch.device("cpu"))
    assert trainer.micro_batch == 2 and trainer.fake.sizes == [8, 4, 2]
    assert all(p.grad is None for p in trainer.model.parameters())
    assert any(r.getMessage().startswith("micro-batch 2 sequences (8 a step in 4 micro-batches)")
               for r in caplog.records)
    assert trainer.train_step().tokens == 256


def test_a_compilation_that_fails_falls_back_to_eager_and_training_goes_on(corpus, caplog):
    reference, trainer = make(corpus), make(corpus)

    def fake_compile(fn):  # a fake torch.compile whose backend fails at the first call
        def compiled(*args):
            raise RuntimeError("fake backend: no C++ compiler\nmore detail")
        return compiled

    trainer.loss_fn = LossFunction(trainer.model, "on", "cpu", compile_fn=fake_compile)
    assert trainer.loss_fn.mode == "compiled"
    with caplog.at_level(logging.WARNING, logger="node.train.accelerator"):
        assert trainer.train_step().loss == reference.train_step().loss
    assert trainer.loss_fn.mode == "eager" and "fake backend" in trainer.loss_fn.reason
    assert [r.getMessage() for r in caplog.records] == [
        "torch.compile failed (RuntimeError: fake backend: no C++ compiler), so training goes on eager."]


def test_compile_auto_is_for_cuda_only(corpus):
    assert make(corpus, ["train.compile=auto"]).loss_fn.describe() == \
        "eager (train.compile = auto compiles on CUDA only, and this is cpu)"


def test_a_gpu_index_that_does_not_exist_is_refused():
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="train.device = 'cuda:1' is not available"):
            pick_device("cuda:1")
    else:
        count = torch.cuda.device_count()
        with pytest.raises(RuntimeError, match=f"names GPU {count}, and this machine has {count}"):
            pick_device(f"cuda:{count}")
    with pytest.raises(ConfigError, match="'train.device' = 'gpu1' is not allowed"):
        load_config(overrides=["train.device='gpu1'"])
    assert load_config(overrides=['train.device="cuda:3"']).train.device == "cuda:3"


def test_doctor_and_the_status_view_say_which_precision_and_why(corpus):
    from node.config.manifest import Manifest
    from node.events import DeviceUse, EventBus
    from node.ops.doctor import check_device, device_use_text
    from node.ops.status import NodeStatus
    from node.ops.status_feed import StatusFeed

    manifest = Manifest()
    manifest.train.device = "cpu"
    finding = check_device(manifest)
    assert finding.level == "ok"
    assert finding.text == ("training runs on cpu, in fp32: a CPU trains in fp32, eager "
                               "(train.compile = auto compiles on CUDA only, and this is cpu).")
    assert device_use_text("bf16: compute capability 9.0 has bf16 units (>= 8.0)", "off", "cuda") \
        == "in bf16: compute capability 9.0 has bf16 units (>= 8.0), eager (train.compile = off)"
    manifest.train.precision = "fp16"
    assert check_device(manifest).level == "fail"
    assert "train.precision = fp16 needs a CUDA device" in check_device(manifest).text

    trainer = make(corpus)
    FakeAllocator(trainer.model, capacity_rows=1)
    trainer.train_step()
    status = NodeStatus()
    bus = EventBus()
    StatusFeed(status, param_bytes=0, snapshot_sets=1, traffic=lambda: (0, 0),
               peers_known=lambda: 0).subscribe(bus)
    bus.publish(trainer.device_use())
    assert (status.precision, status.compute, status.micro_batch) == \
        ("fp32: a CPU trains in fp32", "eager (train.compile = off)", 1)
    assert isinstance(trainer.device_use(), DeviceUse)
