"""Host memory of one node as a function of model size (issue 21), measured part by part.

    nice -n 10 .venv/bin/python benchmarks/node_memory.py --models tiny small
    python benchmarks/node_memory.py --device cuda --batch 16 --seq-len 1024 --models tiny small medium

Each model runs in a fresh process (fp32 weights; on CUDA the inner step in bf16 autocast), which
builds the parts a NoLoCo or DiLoCoX node holds one after another and reads its own resident set
(VmRSS) after each, and its peak (VmHWM, reset through /proc/self/clear_refs before each part)
while the part is built or used; on CUDA also torch's allocated device memory and its peak:

    weights      the model (InnerTrainer: θ in fp32)
    inner_step   one AdamW step (--batch x --seq-len tokens): after it, AdamW's two moments;
                 its peak adds the gradients and activations
    noloco       NoLoCo's outer state: φ and the outer momentum
    dilocox      DiLoCoX's outer state: φ, the momentum and the error feedback (NoLoCo's freed)
    snapshot     the round's end: the offered snapshot (φ, Δ copies, kept while its pair may land)
                 and its wire encoding (the manifest's: θ in bf16 for the local swarm)
    outer_step   NoLoCo's local update
    pair_correction  a partner's snapshot received, decoded onto the device and applied
    state_serve  encoding the late-join state (φ and momentum in fp32) for a requester
    state_adopt  receiving it (one buffer of its bytes, as the transport does) and decoding it
    checkpoint   writing the checkpoint the daemon writes (trainer and outer state)

Models beyond this machine's budget are computed from the bytes per parameter of each part's
tensors (`formula`), marked "measured": false. Writes benchmarks/node_memory.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "node_memory.json"
VOCAB = {"tiny": 256}  # the paper's shapes use a 32k vocabulary
PAPER_VOCAB = 32_000
MB = 1e6


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Meter:
    """Resident memory after each part and the peak while it ran, in MB; on a CUDA node the
    device's allocated memory likewise (torch's allocator: what tensors hold, not its cache)."""

    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device.type == "cuda"
        self.parts: dict[str, dict] = {}
        self.before = self._rss()
        self.before_gpu = 0.0

    @staticmethod
    def _rss() -> float:
        return status_kb("VmRSS") * 1024 / MB

    def start(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.before = self._rss()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.before_gpu = self.torch.cuda.memory_allocated() / MB

    def stop(self, name: str) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        rss, peak = self._rss(), status_kb("VmHWM") * 1024 / MB
        part = {"held_mb": round(rss - self.before, 1), "peak_extra_mb": round(peak - self.before, 1),
                "rss_after_mb": round(rss, 1), "peak_rss_mb": round(peak, 1)}
        line = f"  {name:15s} held {rss - self.before:9.1f} MB, peak +{peak - self.before:9.1f} MB, rss {rss:9.1f} MB"
        if self.cuda:
            cuda = self.torch.cuda
            gpu, gpu_peak = cuda.memory_allocated() / MB, cuda.max_memory_allocated() / MB
            part |= {"gpu_held_mb": round(gpu - self.before_gpu, 1),
                     "gpu_peak_extra_mb": round(gpu_peak - self.before_gpu, 1),
                     "gpu_allocated_mb": round(gpu, 1), "gpu_peak_mb": round(gpu_peak, 1),
                     "gpu_reserved_mb": round(cuda.memory_reserved() / MB, 1)}
            line += f"; GPU held {gpu - self.before_gpu:9.1f} MB, peak +{gpu_peak - self.before_gpu:9.1f} MB"
        self.parts[name] = part
        print(line, file=sys.stderr, flush=True)


def as_received(kind: str, tensors: list):
    """A message as the transport hands it over: its bytes in one receive buffer."""
    import numpy as np

    from p2p.messages import OutgoingMessage, ReceivedMessage
    sent = OutgoingMessage(kind, 0, tensors)
    buffer, offset = np.empty(sent.total_bytes, np.uint8), 0
    for segment in sent.segments():
        buffer[offset:offset + len(segment)] = np.frombuffer(segment, np.uint8)
        offset += len(segment)
    return ReceivedMessage(None, None, sent.manifest(), memoryview(buffer)), sent.total_bytes


def kept_for_backward(trainer) -> int:
    """Bytes of the distinct storages that one micro-batch's forward pass keeps for its backward
    one, parameters included (an exact count, where resident memory is blurred by reuse). With
    activation checkpointing the blocks' insides are not kept (nor counted: each block's input,
    which the checkpoint keeps, is not seen by these hooks)."""
    import torch
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens, targets = (t.to(trainer.device) for t in trainer.stream.next())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), trainer._autocast():
        loss = trainer.model.loss(tokens, targets)
    del loss
    return sum(storages.values())


def measure(model: str, device_name: str, batch: int, seq_len: int, recompute: bool) -> dict:
    """One model's parts, in this process, on `device_name` (θ, AdamW and NoLoCo's φ and δ on
    it, as the daemon keeps them; DiLoCoX's outer state on the host)."""
    import torch

    from node.config.manifest import load_manifest
    from node.data.corpus import load_corpus
    from node.rounds.dilocox.round import codec_for
    from node.rounds.noloco.payload import decode_snapshot, encode_snapshot
    from node.rounds.state import decode_state, encode_state
    from node.train.checkpoint import CheckpointStore
    from node.train.trainer import InnerTrainer
    from protocol.dilocox import DiLoCoX
    from protocol.noloco import NoLoCo, NoLoCoHyperParameters, NoLoCoSnapshot, theta_only_snapshot
    from protocol.tensors import shift_in_place

    torch.set_num_threads(2)
    device = torch.device(device_name)
    vocab = VOCAB.get(model, PAPER_VOCAB)
    m = load_manifest(ROOT / "configs/swarms/local.toml",
                      {"model": {"preset": model, "vocab_size": vocab},
                       "train": {"micro_batch_size": batch, "tokens_per_step": batch * seq_len,
                                 "device": device_name} | ({"activation_checkpointing": True} if recompute else {}),
                       "data": {"seq_len": seq_len}})
    corpus = load_corpus(m.data)
    meter = Meter(device)
    meter.start()
    trainer = InnerTrainer(m.model, m.train, corpus, m.data.seq_len, 0, device)
    meter.stop("weights")
    params = sum(p.numel() for p in trainer.model.parameters())
    meter.start()
    trainer.train_step()
    meter.stop("inner_step")
    kept = kept_for_backward(trainer)
    weights = {k: v.detach() for k, v in trainer.named_parameters().items()}
    meter.start()
    noloco = NoLoCo(weights, NoLoCoHyperParameters())
    meter.stop("noloco")
    layout, wire = m.protocol.snapshot, m.protocol.wire_dtype
    meter.start()  # the round's end: the offered snapshot is kept while its pair may land
    own = noloco.snapshot(weights)
    offered = encode_snapshot(own, wire, layout)
    meter.stop("snapshot")
    meter.start()
    noloco.outer_step(own)
    meter.stop("outer_step")
    meter.start()  # a partner's snapshot (here our own bytes) decoded, checked and applied
    message, snapshot_bytes = as_received("snapshot", offered)
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    groups = decode_snapshot(message, layout, "partner", wire, shapes, device)
    partner = theta_only_snapshot(groups["theta"], noloco.hyper) if layout == "theta" else \
        NoLoCoSnapshot(groups["phi"], groups["delta"])
    del groups, message  # as the round's check returns only the snapshot
    correction = noloco.late_pair_correction(own, [partner])
    shift_in_place(weights, correction)
    del partner, correction, offered
    meter.stop("pair_correction")
    meter.start()
    served = encode_state({"phi": noloco.slow_weights, "momentum": noloco.outer_momentum})
    meter.stop("state_serve")
    meter.start()
    received, state_bytes = as_received("state", served)
    groups, _ = decode_state(received)
    meter.stop("state_adopt")
    del groups, received, served
    checkpoint_bytes = None
    if device.type == "cpu":  # host memory alone, measured on the CPU (a `medium` file is 27 GB)
        meter.start()
        with tempfile.TemporaryDirectory(prefix="lowcomm-mem-") as directory:
            CheckpointStore(directory).save({"trainer": trainer.state_dict(), "noloco": noloco.state_dict()}, 1)
            checkpoint_bytes = sum(p.stat().st_size for p in Path(directory).iterdir())
        meter.stop("checkpoint")
    del noloco, own
    meter.start()
    dilocox = DiLoCoX(trainer.host_parameters(), codec_for(m.protocol), "me")
    meter.stop("dilocox")
    del dilocox
    row = {"model": model, "vocab": vocab, "parameters": params, "measured": True,
           "device": device_name, "batch": batch, "seq_len": seq_len,
           "activation_checkpointing": recompute, "kept_for_backward_mb": round(kept / MB, 1),
           "snapshot": f"{layout} in {wire}", "snapshot_bytes": snapshot_bytes,
           "state_bytes": state_bytes, "checkpoint_bytes": checkpoint_bytes, "parts": meter.parts,
           "peak_rss_mb": max(p["peak_rss_mb"] for p in meter.parts.values())}
    if device.type == "cuda":
        row |= {"gpu": torch.cuda.get_device_name(device),
                "gpu_peak_mb": max(p["gpu_peak_mb"] for p in meter.parts.values())}
    return row


# Bytes per parameter of each part, (held after it, extra at its peak), from the dtypes the code
# uses (fp32 tensors on a CPU node; `w` the snapshot's wire bytes a parameter): what `computed`
# multiplies. Measured on `small`, each agrees within allocator noise where memory freed by an
# earlier part is not reused (benchmarks/NOTEBOOK.md); activations (batch x sequence, not n) are
# left out of inner_step's peak, and the checkpoint's peak is the measured ratio.
def formula(w: float) -> dict[str, tuple[float, float]]:
    return {"weights": (4, 4),                   # θ
            "inner_step": (8, 12),               # AdamW's two moments; + the gradients at its peak
            "noloco": (8, 8),                    # φ and the outer momentum
            "snapshot": (8 + w, 12 + w),         # the offered (φ, Δ) copies and the wire θ; + θ while encoding
            "state_serve": (8, 8),               # φ and momentum copied under the round's lock
            "state_adopt": (16, 16),             # the receive buffer and the decoded fp32 copies
            "dilocox": (12, 12)}                 # φ, momentum, error feedback


def computed(model: str, reference: dict) -> dict:
    """A model's parts from `formula`, and its checkpoint's peak from `reference`'s ratio."""
    from node.config.manifest import load_manifest
    from node.rounds.message_sizes import message_bounds, parameter_shapes
    m = load_manifest(ROOT / "configs/swarms/local.toml", {"model": model})
    vocab = VOCAB.get(model, PAPER_VOCAB)
    shapes = parameter_shapes(m, vocab)
    params = sum(math.prod(s) for s in shapes.values())
    found = {b.what.split(" (")[0]: b.total_bytes for b in message_bounds(m, shapes)}
    w = found["a NoLoCo snapshot"] / params
    parts = {name: {"held_mb": round(held * params / MB, 1), "peak_extra_mb": round(peak * params / MB, 1)}
             for name, (held, peak) in formula(w).items()}
    if "checkpoint" in reference["parts"]:  # measured on the CPU only
        ratio = reference["parts"]["checkpoint"]["peak_extra_mb"] / reference["parameters"]
        parts["checkpoint"] = {"peak_extra_mb": round(ratio * params, 1)}
    return {"model": model, "vocab": vocab, "parameters": params, "measured": False,
            "snapshot": f"{m.protocol.snapshot} in {m.protocol.wire_dtype}",
            "snapshot_bytes": found["a NoLoCo snapshot"], "state_bytes": found["the late-join state"],
            "checkpoint_bytes": reference["checkpoint_bytes"] and
            round(reference["checkpoint_bytes"] / reference["parameters"] * params),
            "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="measured models")
    parser.add_argument("--computed", nargs="*", default=["medium", "large"], help="computed models")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU's memory too")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the measured inner step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="train.activation_checkpointing in the measured step")
    parser.add_argument("--json", type=Path, help=f"where the rows go (default {OUT.name}; "
                        "with --device cuda, node_memory_cuda.json)")
    parser.add_argument("--recompute", action="store_true",
                        help="keep the measured rows of the last run, recompute the others")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: measure this model
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.device, args.batch, args.seq_len,
                                 args.activation_checkpointing)))
        return
    out = args.json or (OUT if args.device == "cpu" else OUT.with_name("node_memory_cuda.json"))
    rows = [r for r in json.loads(out.read_text())["rows"] if r["measured"]] if args.recompute else []
    for model in [] if args.recompute else args.models:
        print(f"{model}:", file=sys.stderr, flush=True)
        started = time.time()
        child = subprocess.run([sys.executable, __file__, "--one", model, "--device", args.device,
                                "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                                *(["--activation-checkpointing"] if args.activation_checkpointing else [])],
                               stdout=subprocess.PIPE,
                               text=True, check=True, timeout=1800)
        rows.append({**json.loads(child.stdout), "seconds": round(time.time() - started, 1)})
    reference = max(rows, key=lambda r: r["parameters"])
    rows += [computed(model, reference) for model in args.computed]
    command = json.loads(out.read_text())["command"] if args.recompute else \
        " ".join(["benchmarks/node_memory.py", *sys.argv[1:]])
    out.write_text(json.dumps({"command": command,
                               "cpu_count": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
