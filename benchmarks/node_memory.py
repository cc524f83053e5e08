"""Host memory of one node as a function of model size (issue 21), measured part by part.

    nice -n 10 .venv/bin/python benchmarks/node_memory.py --models tiny small

Each model runs in a fresh process (CPU, fp32), which builds the parts a NoLoCo or DiLoCoX node
holds one after another and reads its own resident set (VmRSS) after each, and its peak (VmHWM,
reset through /proc/self/clear_refs before each part) while the part is built or used:

    weights      the model (InnerTrainer: θ in fp32)
    inner_step   one AdamW step (micro-batch 1 x 128 tokens): after it, AdamW's two moments;
                 its peak adds the gradients and activations
    noloco       NoLoCo's outer state: φ and the outer momentum
    dilocox      DiLoCoX's outer state: φ, the momentum and the error feedback (NoLoCo's freed)
    snapshot     encoding θ as the manifest's snapshot (int8 θ by default), held while offered
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
    """Resident memory after each part and the peak while it ran, in MB."""

    def __init__(self):
        self.parts: dict[str, dict] = {}
        self.before = self._rss()

    @staticmethod
    def _rss() -> float:
        return status_kb("VmRSS") * 1024 / MB

    def start(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.before = self._rss()

    def stop(self, name: str) -> None:
        rss, peak = self._rss(), status_kb("VmHWM") * 1024 / MB
        self.parts[name] = {"held_mb": round(rss - self.before, 1), "peak_extra_mb": round(peak - self.before, 1),
                            "rss_after_mb": round(rss, 1), "peak_rss_mb": round(peak, 1)}
        print(f"  {name:12s} held {rss - self.before:9.1f} MB, peak +{peak - self.before:9.1f} MB, "
              f"rss {rss:9.1f} MB", file=sys.stderr, flush=True)


def measure(model: str) -> dict:
    """One model's parts, in this process."""
    import numpy as np
    import torch

    from node.config.manifest import load_manifest
    from node.data.corpus import load_corpus
    from node.rounds.dilocox.round import codec_for
    from node.rounds.noloco.payload import encode_snapshot
    from node.rounds.state import decode_state, encode_state
    from node.train.checkpoint import CheckpointStore
    from node.train.trainer import InnerTrainer
    from p2p.messages import OutgoingMessage, ReceivedMessage
    from protocol.dilocox import DiLoCoX
    from protocol.noloco import NoLoCo, NoLoCoHyperParameters, NoLoCoSnapshot

    torch.set_num_threads(2)
    vocab = VOCAB.get(model, PAPER_VOCAB)
    m = load_manifest(ROOT / "configs/swarms/local.toml",
                      {"model": {"preset": model, "vocab_size": vocab},
                       "train": {"micro_batch_size": 1, "tokens_per_step": 128}, "data": {"seq_len": 128}})
    corpus = load_corpus(m.data)
    meter = Meter()
    meter.start()
    trainer = InnerTrainer(m.model, m.train, corpus, m.data.seq_len, 0, torch.device("cpu"))
    meter.stop("weights")
    params = sum(p.numel() for p in trainer.model.parameters())
    meter.start()
    trainer.train_step()
    meter.stop("inner_step")
    weights = {k: v.detach() for k, v in trainer.named_parameters().items()}
    meter.start()
    noloco = NoLoCo(weights, NoLoCoHyperParameters())
    meter.stop("noloco")
    meter.start()
    snapshot = NoLoCoSnapshot(noloco.slow_weights, {k: v - noloco.slow_weights[k] for k, v in weights.items()})
    offered = encode_snapshot(snapshot, m.protocol.wire_dtype, m.protocol.snapshot)
    del snapshot
    meter.stop("snapshot")
    snapshot_bytes = sum(memoryview(t.data).nbytes for t in offered)
    del offered
    meter.start()
    served = OutgoingMessage("state", 0, encode_state({"phi": noloco.slow_weights,
                                                       "momentum": noloco.outer_momentum}))
    meter.stop("state_serve")
    meter.start()
    buffer = np.empty(served.total_bytes, np.uint8)  # the transport's receive buffer
    offset = 0
    for segment in served.segments():
        buffer[offset:offset + len(segment)] = np.frombuffer(segment, np.uint8)
        offset += len(segment)
    received = ReceivedMessage(None, None, served.manifest(), memoryview(buffer))
    groups, _ = decode_state(received)
    meter.stop("state_adopt")
    state_bytes = served.total_bytes
    del groups, received, buffer, served
    meter.start()
    with tempfile.TemporaryDirectory(prefix="lowcomm-mem-") as directory:
        CheckpointStore(directory).save({"trainer": trainer.state_dict(), "noloco": noloco.state_dict()}, 1)
        checkpoint_bytes = sum(p.stat().st_size for p in Path(directory).iterdir())
    meter.stop("checkpoint")
    del noloco
    meter.start()
    dilocox = DiLoCoX(weights, codec_for(m.protocol), "me")
    meter.stop("dilocox")
    del dilocox
    return {"model": model, "vocab": vocab, "parameters": params, "measured": True,
            "snapshot": f"{m.protocol.snapshot} in {m.protocol.wire_dtype}", "snapshot_bytes": snapshot_bytes,
            "state_bytes": state_bytes, "checkpoint_bytes": checkpoint_bytes, "parts": meter.parts,
            "peak_rss_mb": max(p["peak_rss_mb"] for p in meter.parts.values())}


# Bytes per parameter of each part, (held after it, extra at its peak), from the dtypes the code
# uses (fp32 tensors on a CPU node; `w` the snapshot's wire bytes a parameter): what `computed`
# multiplies. Measured on `small`, each agrees within allocator noise where memory freed by an
# earlier part is not reused (benchmarks/RESULTS.md); activations (batch x sequence, not n) are
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
    ratio = reference["parts"]["checkpoint"]["peak_extra_mb"] / reference["parameters"]
    parts["checkpoint"] = {"peak_extra_mb": round(ratio * params, 1)}
    return {"model": model, "vocab": vocab, "parameters": params, "measured": False,
            "snapshot": f"{m.protocol.snapshot} in {m.protocol.wire_dtype}",
            "snapshot_bytes": found["a NoLoCo snapshot"], "state_bytes": found["the late-join state"],
            "checkpoint_bytes": round(reference["checkpoint_bytes"] / reference["parameters"] * params),
            "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="measured models")
    parser.add_argument("--computed", nargs="*", default=["medium", "large"], help="computed models")
    parser.add_argument("--recompute", action="store_true",
                        help="keep the measured rows of the last run, recompute the others")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: measure this model
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    rows = [r for r in json.loads(OUT.read_text())["rows"] if r["measured"]] if args.recompute else []
    for model in [] if args.recompute else args.models:
        print(f"{model}:", file=sys.stderr, flush=True)
        started = time.time()
        child = subprocess.run([sys.executable, __file__, "--one", model], stdout=subprocess.PIPE,
                               text=True, check=True, timeout=1800)
        rows.append({**json.loads(child.stdout), "seconds": round(time.time() - started, 1)})
    reference = max(rows, key=lambda r: r["parameters"])
    rows += [computed(model, reference) for model in args.computed]
    command = json.loads(OUT.read_text())["command"] if args.recompute else \
        " ".join(["benchmarks/node_memory.py", *sys.argv[1:]])
    OUT.write_text(json.dumps({"command": command,
                               "cpu_count": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
