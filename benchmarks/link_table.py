"""The link each model preset needs, per protocol: a markdown table of what one node's round
moves, the late joiner's download, and the rates they need at a round's length.

Bytes come from the node's own sizing (node/rounds/traffic.py: the NoLoCo snapshot and the state
as message_sizes.py bounds them, a DiLoCoX message from its codec's layout), for a manifest with
the schema's defaults (node/config/manifest.py ProtocolSection: what a new manifest gets;
NoLoCo: int4 θ snapshots, H = 50, pairing at most once every max_swap_rounds = 4 rounds at its
least; DiLoCoX: low-rank rank 4 at 8 bits, H = 50, committee of 8 senders, fan-out 32), the
presets of configs/models/, and a swarm of --members nodes. "dilocox + controller" is the same
with protocol.controller on: its least is the controller's floor (rank 1, 4 bits).

A round lasts H steps; a step's seconds per device (STEP_SOURCES):
- `h100`: measured for `small` on one H100 (benchmarks/NOTEBOOK.md, "The CUDA path on one
  H100": 234,781 tokens/s, 16,384 tokens a step, so 0.070 s a step at 18.3% MFU); the other
  presets at 16,384 tokens a step and the same MFU, scaled by FLOPs a token (6·N + 12·L·d·T,
  benchmarks/trainer_throughput.py): an estimate, larger models usually run at a higher MFU
  (shorter steps, faster links needed);
- `consumer`: an assumed RTX 4090-class GPU, 165 TFLOP/s dense bf16 at the same 18.3% MFU, not
  measured; `large` does not fit its 24 GB (16 bytes a parameter of weights, gradients and
  AdamW moments, before activations) and is left out; `medium` (21.5 GB of them) barely does;
- `cpu`: `tiny` only, measured on this project's 2-core machine (benchmarks/NOTEBOOK.md, "Inner
  trainer throughput": 8,092 tokens/s at 2,048 tokens a step, 0.253 s a step).

    .venv/bin/python benchmarks/link_table.py [--members 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.trainer_throughput import flops_per_token  # noqa: E402
from node.config.manifest import Manifest, manifest_from_dict  # noqa: E402
from node.rounds.traffic import link_need, round_traffic  # noqa: E402
from node.train.model import build_model, count_parameters  # noqa: E402

H100_SMALL_TOKENS_PER_S = 234_781    # measured, benchmarks/gpu_check_h100.json
H100_PEAK_FLOPS = 989.4e12           # dense bf16, SXM
CONSUMER_PEAK_FLOPS = 165.2e12       # assumed: RTX 4090, dense bf16 with fp32 accumulation
CONSUMER_MEMORY_BYTES = 24 * 2**30
TRAINING_BYTES_PER_PARAM = 16        # fp32 weights, gradients, AdamW's two moments
CPU_TINY_TOKENS_PER_S = 8_092        # measured, 2 cores (benchmarks/NOTEBOOK.md, "Inner trainer throughput")
GPU_TOKENS_PER_STEP, GPU_SEQ_LEN, GPU_VOCAB = 16_384, 1024, 32_000   # the H100 run's shape
CPU_TOKENS_PER_STEP, CPU_SEQ_LEN, CPU_VOCAB = 2_048, 128, 256        # the tiny swarms' shape
PROTOCOLS = {"noloco": {"name": "noloco"}, "dilocox": {"name": "dilocox"},
             "dilocox + controller": {"name": "dilocox", "controller": True}}


@dataclass(frozen=True)
class Row:
    preset: str
    parameters: int
    protocol: str
    device: str
    step_seconds: float
    inner_steps: int
    round_seconds: float
    message_bytes: int
    up_bytes: float
    down_bytes: float
    join_bytes: int
    up_mbit: float
    down_mbit: float
    least_up_mbit: float
    least_down_mbit: float
    least_how: str
    join_mbit_one_round: float


def manifest_for(preset: str, protocol: dict, gpu: bool) -> Manifest:
    seq_len, vocab, tokens = (GPU_SEQ_LEN, GPU_VOCAB, GPU_TOKENS_PER_STEP) if gpu else \
        (CPU_SEQ_LEN, CPU_VOCAB, CPU_TOKENS_PER_STEP)
    return manifest_from_dict({"model": {"preset": preset, "vocab_size": vocab},
                               "data": {"seq_len": seq_len},
                               "train": {"micro_batch_size": 16, "tokens_per_step": tokens},
                               "protocol": protocol})


def step_seconds(manifest: Manifest, device: str) -> float:
    if device == "cpu":
        return manifest.train.tokens_per_step / CPU_TINY_TOKENS_PER_S
    model = build_model(manifest.model, manifest.model.vocab_size, "meta")
    small = manifest_for("small", {}, gpu=True)
    h100_small_flops = H100_SMALL_TOKENS_PER_S * flops_per_token(
        small, build_model(small.model, GPU_VOCAB, "meta"))
    mfu = h100_small_flops / H100_PEAK_FLOPS
    peak = H100_PEAK_FLOPS if device == "h100" else CONSUMER_PEAK_FLOPS
    return manifest.train.tokens_per_step * flops_per_token(manifest, model) / (mfu * peak)


def devices_for(preset: str, parameters: int) -> list[str]:
    if preset == "tiny":
        return ["cpu"]
    fits = TRAINING_BYTES_PER_PARAM * parameters < CONSUMER_MEMORY_BYTES
    return ["h100", "consumer"] if fits else ["h100"]


def rows(presets: list[str], members: int) -> list[Row]:
    out = []
    for preset in presets:
        for protocol, fields in PROTOCOLS.items():
            manifest = manifest_for(preset, fields, gpu=preset != "tiny")
            parameters = count_parameters(build_model(manifest.model, manifest.model.vocab_size, "meta"))
            traffic = round_traffic(manifest, manifest.model.vocab_size, members)
            for device in devices_for(preset, parameters):
                step = step_seconds(manifest, device)
                need = link_need(traffic, manifest.protocol.inner_steps * step)
                out.append(Row(preset, parameters, protocol, device, step, manifest.protocol.inner_steps,
                               need.round_seconds, traffic.message_bytes, traffic.up_bytes,
                               traffic.down_bytes, traffic.join_bytes, need.up_bps / 1e6,
                               need.down_bps / 1e6, need.least_up_bps / 1e6, need.least_down_bps / 1e6,
                               traffic.least_how or "none", need.join_bps / 1e6))
    return out


def table(found: list[Row]) -> str:
    lines = ["| preset (parameters) | protocol | device, step | round | up / down a round | join download "
             "| link for every round, up / down | least link, up / down (how) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in found:
        lines.append(f"| {r.preset} ({r.parameters / 1e6:,.1f}M) | {r.protocol} "
                     f"| {r.device}, {r.step_seconds:.3f} s "
                     f"| {r.round_seconds:.1f} s | {r.up_bytes / 1e6:,.1f} / {r.down_bytes / 1e6:,.1f} MB "
                     f"| {r.join_bytes / 1e9:,.2f} GB | {r.up_mbit:,.1f} / {r.down_mbit:,.1f} Mbit/s "
                     f"| {r.least_up_mbit:,.1f} / {r.least_down_mbit:,.1f} Mbit/s ({r.least_how}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,small,medium,large")
    parser.add_argument("--members", type=int, default=8, help="the swarm's size (DiLoCoX's bytes)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    found = rows(args.presets.split(","), args.members)
    print(table(found))
    if args.json:
        args.json.write_text(json.dumps({"members": args.members, "rows": [asdict(r) for r in found]},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
