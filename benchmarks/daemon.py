"""Tokens/s of a daemon inside an N-node NoLoCo swarm against the plain trainer alone, one run.

Both sides run N processes at once on this machine (the same CPU share each), the same model,
batch, threads and steps: the baseline is N `lowcomm-node train` processes (no network), ours is
N `lowcomm-node join` daemons on loopback (overlap timing). A node's rate is wall-clock: tokens
of the steps between the warm-up and the last step, divided by the time between them, so round
ends, outer steps and any waiting on the network count against the swarm.

    .venv/bin/python benchmarks/daemon.py --nodes 4 --steps 150
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.config.schema import to_toml  # noqa: E402
from node.config.manifest import find_manifest, load_manifest  # noqa: E402
from tests.swarm_harness import SwarmHarness  # noqa: E402


def wall_rate(events: list[dict], tokens_per_step: int, warmup: int) -> float:
    steps = [e for e in events if e["event"] == "step"]
    steps = {e["step"]: e["time"] for e in steps}
    first, last = warmup, max(steps)
    return (last - first) * tokens_per_step / (steps[last] - steps[first])


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=25)
    parser.add_argument("--swarm", default="local")
    args = parser.parse_args()
    manifest = load_manifest(find_manifest(args.swarm), {"train": {"threads": 1}})
    manifest.swarm.id = "bench-daemon"
    tokens = manifest.train.tokens_per_step
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        config = base / "train.toml"
        values = {k: manifest.to_dict()[k] for k in ("model", "data", "train")}
        config.write_text(to_toml(values))
        plain = []
        procs = [subprocess.Popen([sys.executable, "-m", "node.cli", "train", "--config",
                                   str(config), "--data-dir", str(base / f"plain-{i}"), "--set",
                                   f"train.steps={args.steps}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for i in range(args.nodes)]
        for i, proc in enumerate(procs):
            proc.wait()
            plain.append(wall_rate(read_events(base / f"plain-{i}" / "metrics.jsonl"), tokens,
                                   args.warmup))
        harness = SwarmHarness(base / "swarm", manifest)
        try:
            nodes = harness.start(args.nodes, extra=["--max-steps", str(args.steps)])
            for node in nodes:
                node.wait_for(lambda ev: any(e["event"] == "left" for e in ev), 1800, "the end")
            swarm = [wall_rate(node.events(), tokens, args.warmup) for node in nodes]
            paired = [sum(1 for r in node.events("round") if r["partner"]) for node in nodes]
            rounds = [len(node.events("round")) for node in nodes]
        finally:
            harness.close()
    print(f"{args.nodes} processes at once, {manifest.model.preset} model, "
          f"{tokens} tokens/step, H = {manifest.protocol.inner_steps}, 1 thread each, "
          f"{args.steps} steps, rates after step {args.warmup}")
    print("| side | tokens/s per node (median) | per node |")
    print("|---|---|---|")
    print(f"| plain trainer alone | {statistics.median(plain):,.0f} | "
          f"{', '.join(f'{r:,.0f}' for r in plain)} |")
    print(f"| daemon in a NoLoCo swarm (overlap) | {statistics.median(swarm):,.0f} | "
          f"{', '.join(f'{r:,.0f}' for r in swarm)} |")
    print(f"ratio swarm / plain = {statistics.median(swarm) / statistics.median(plain):.3f}; "
          f"rounds with a partner per node: {paired} of {rounds}")


if __name__ == "__main__":
    main()
