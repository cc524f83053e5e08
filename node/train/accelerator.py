"""How the inner trainer uses its device: the precision, compilation and the micro-batch.

Each is a node-local choice (train.precision, train.compile, train.micro_batch_probe: never in
the manifest's digest), because none of them changes what a step computes beyond rounding:

- Precision: `choose_precision` maps a device's kind and compute capability to bf16 autocast
  (CUDA capability >= 8.0, which has bf16 arithmetic units), fp16 autocast with loss scaling
  (older CUDA cards: T4, V100, the RTX 20 series) or fp32 (a CPU, MPS). A pure function, so
  one table tests every card.
- Compilation: `LossFunction` is the model's loss, run through torch.compile where it is wanted
  (train.compile: on, off, or auto = on CUDA only) and available; a compilation that fails
  falls back to eager once, with one sentence saying why, and training goes on. Only the
  inner model's forward and backward are compiled: the protocols' arithmetic stays eager.
- Micro-batch: a step's sequences (tokens_per_step / seq_len of them, the swarm's agreed
  tokens) are split into equal micro-batches of a size that divides them, and the gradients
  accumulated; `probe_micro_batch` finds the largest such size that fits the device, and
  `smaller_micro_batch` is the next size down after an out-of-memory error. Any split sums the
  same per-token losses, so the step is the same up to the order of its additions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.config.schema import ConfigError

log = logging.getLogger(__name__)

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first CUDA cards with bf16 arithmetic units
PRECISION_CHOICES = ("auto", "bf16", "fp16", "fp32")
SWITCH_CHOICES = ("auto", "on", "off")  # train.compile, train.micro_batch_probe
# a probed micro-batch must leave this share of the device's memory free (the optimizer's
# state, allocated at its first step, and the allocator's fragmentation)
PROBE_HEADROOM = 0.1


@dataclass(frozen=True)
class Precision:
    name: str      # bf16 | fp16 | fp32
    reason: str    # one clause: why this one on this device

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype; None for fp32 (no autocast)."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def loss_scaling(self) -> bool:
        """fp16's narrow exponent underflows small gradients unless the loss is scaled up."""
        return self.name == "fp16"

    def describe(self) -> str:
        scaled = " with loss scaling" if self.loss_scaling else ""
        return f"{self.name}{scaled}: {self.reason}"


def choose_precision(device_type: str, capability: tuple[int, int] | None,
                     requested: str = "auto") -> Precision:
    """The precision of a device of this kind and CUDA compute capability (None off CUDA).

    auto: bf16 on CUDA capability >= 8.0, fp16 (loss-scaled) below, fp32 elsewhere. A requested
    bf16 or fp16 is honoured where the device can run it; otherwise ConfigError in one sentence.
    """
    if requested not in PRECISION_CHOICES:
        raise ConfigError(f"train.precision = {requested!r} is not one of {', '.join(PRECISION_CHOICES)}")
    if device_type != "cuda":
        if requested in ("bf16", "fp16"):
            raise ConfigError(f"train.precision = {requested} needs a CUDA device, and this node "
                             f"trains on {device_type}: use auto or fp32")
        return Precision("fp32", f"a {device_type.upper()} trains in fp32"
                         + (" (train.precision = fp32)" if requested == "fp32" else ""))
    cap = capability or (0, 0)
    shown = f"compute capability {cap[0]}.{cap[1]}"
    has_bf16 = cap >= BF16_MIN_CAPABILITY
    if requested == "auto":
        if has_bf16:
            return Precision("bf16", f"{shown} has bf16 units (>= 8.0)")
        return Precision("fp16", f"{shown} has no bf16 units (< 8.0)")
    if requested == "bf16" and not has_bf16:
        raise ConfigError(f"train.precision = bf16 needs CUDA compute capability >= 8.0, and this "
                         f"card has {cap[0]}.{cap[1]}: use auto or fp16")
    return Precision(requested, f"train.precision = {requested} on {shown}")


def device_precision(device: torch.device, requested: str = "auto") -> Precision:
    """`choose_precision` for this machine's device."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_precision(device.type, capability, requested)


def autocast(device: torch.device, precision: Precision):
    if precision.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.dtype)


# ------------------------------------------------------------------------------ compilation

def compile_unavailable(device_type: str) -> str | None:
    """Why torch.compile cannot run for this device here, in one clause; None when it can."""
    try:
        import torch._dynamo  # noqa: F401
        from torch._dynamo import is_dynamo_supported
    except ImportError as error:  # pragma: no cover - torch builds without dynamo
        return f"this torch has no torch.compile ({error})"
    if not is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device_type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return "triton, which torch.compile needs for CUDA kernels, is not installed"
    return None


def eager_reason(setting: str, device_type: str) -> str | None:
    """Why the model will run eager with train.compile = `setting` on this device, in one
    clause; None when it will be compiled (a compilation may still fail at its first step)."""
    if setting not in SWITCH_CHOICES:
        raise ConfigError(f"train.compile = {setting!r} is not one of {', '.join(SWITCH_CHOICES)}")
    if setting == "off":
        return "train.compile = off"
    if setting == "auto" and device_type != "cuda":
        return f"train.compile = auto compiles on CUDA only, and this is {device_type}"
    return compile_unavailable(device_type)


class LossFunction:
    """`model.loss`, compiled where train.compile wants it and it works, eager otherwise.

    `mode` is "compiled" or "eager", and `reason` says why in one clause. `fall_back(error)`
    turns a compiled one eager for good (logging one sentence) and says whether it did: the
    caller then reruns the micro-batches in eager."""

    def __init__(self, model: torch.nn.Module, setting: str, device_type: str,
                 compile_fn: Callable = torch.compile):
        self.eager = model.loss
        self.compiled = None
        eager = eager_reason(setting, device_type)
        if eager is None:
            self.compiled = compile_fn(model.loss)
            self.reason = f"train.compile = {setting}"
        else:
            self.reason = eager
            if setting != "off" and not eager.startswith("train.compile"):
                log.warning("training runs eager, not compiled: %s.", eager)

    @property
    def mode(self) -> str:
        return "eager" if self.compiled is None else "compiled"

    def describe(self) -> str:
        return f"{self.mode} ({self.reason})"

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (self.compiled or self.eager)(tokens, targets)

    def fall_back(self, error: BaseException) -> bool:
        if self.compiled is None:
            return False
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        self.compiled = None
        self.reason = f"compilation failed ({type(error).__name__}: {first_line})"
        log.warning("torch.compile failed (%s: %s), so training goes on eager.",
                    type(error).__name__, first_line)
        return True


# ------------------------------------------------------------------------------ one daemon per GPU

def gpu_device(index: int, count: int, option: str) -> str:
    """train.device for GPU `index` of a machine with `count` GPUs ("cuda:N"); ConfigError in
    one sentence, naming the `option` that asked, for an index the machine does not have."""
    if 0 <= index < count:
        return f"cuda:{index}"
    has = f"has {count} (0-{count - 1})" if count else "has none that torch can use"
    raise ConfigError(f"{option} names GPU {index}, which this machine does not have: it {has}")


def parse_gpus(text: str) -> list[int]:
    """`local-swarm --gpus 0,1,3`: the GPU indices, each once; ConfigError in one sentence."""
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--gpus {text!r} is not a list of GPU indices: write it like 0,1,2") from None
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"--gpus {text!r} names a GPU twice: each node gets its own")
    return gpus


# ------------------------------------------------------------------------------ micro-batches

def micro_batch_sizes(rows: int) -> list[int]:
    """The micro-batch sizes a step of `rows` sequences can be split into evenly, largest first."""
    return [m for m in range(rows, 0, -1) if rows % m == 0]


def smaller_micro_batch(size: int, rows: int) -> int | None:
    """After an out-of-memory error at `size`: the largest even split of `rows` at most half of
    it; None when `size` is already one sequence."""
    return next((m for m in micro_batch_sizes(rows) if m <= size // 2), None)


@dataclass(frozen=True)
class MicroBatchFit:
    size: int                 # sequences per forward/backward
    peak_bytes: int | None    # the device memory the probe's largest fitting size peaked at
    reason: str               # one clause


def probe_micro_batch(fits: Callable[[int], int | None], rows: int, limit_bytes: int | None) -> MicroBatchFit:
    """The largest even split of a step's `rows` sequences that `fits` (a trial forward and
    backward at that size: its peak memory in bytes, None where it ran out of memory), and
    under `limit_bytes` where one is given. RuntimeError in one sentence when not even one
    sequence fits."""
    tried = []
    for size in micro_batch_sizes(rows):
        peak = fits(size)
        if peak is not None and (limit_bytes is None or peak <= limit_bytes):
            over = f"; {tried[0]} did not fit" if tried else ""
            return MicroBatchFit(size, peak, f"probed: the largest of the step's {rows} sequences' "
                                 f"even splits that fits{over}")
        tried.append(size)
    raise RuntimeError(f"not even one sequence of the step fits this device's memory (tried "
                       f"micro-batches of {', '.join(map(str, tried))}): use a smaller model or "
                       f"set train.activation_checkpointing = true")
