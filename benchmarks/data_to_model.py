"""Real data in, a usable model out (issue 23): the README's commands, run and recorded.

A demonstration, not a comparison (there is no baseline): a byte-level BPE of 4,096 tokens
trained on the embedded corpus, its shards, a swarm manifest pinning them, two `join` daemons
on loopback (`local-swarm`) for a few NoLoCo rounds, node 0's φ exported, loaded by transformers
(its logits compared with our decoder's on validation tokens), `generate` and `perplexity`.
Writes benchmarks/data_to_model.json: each command, its wall time, the validation loss of every
round of both nodes, the logits difference, the perplexity and the generated text.

    .venv/bin/python benchmarks/data_to_model.py --steps 150 --keep

Each finished step is recorded in the work directory (progress.json); `--workdir DIR` on a kept
directory skips the steps recorded there, with their recorded wall times (on a machine shared
with higher-priority jobs a niced run may not finish in one go).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "def read_config(path):"


def run(workdir: Path, *args: str) -> tuple[str, float]:
    """One `lowcomm-node` command in workdir; (its stdout, its wall seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "node.cli", *args], cwd=workdir, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lowcomm-node {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout, time.perf_counter() - started


def round_losses(data_dir: Path) -> list[dict]:
    rows = []
    for line in (data_dir / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "round":
            rows.append({"round": event["round"], "step": event["step"],
                         "val_loss": event.get("val_loss"), "partner": event.get("partner")})
    return rows


def compare_logits(workdir: Path, export: Path, manifest: Path, val_shard: Path) -> dict:
    """transformers' logits against our decoder's, on 4 x 128 validation tokens, fp32."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.config.manifest import load_manifest
    from node.ops.model_source import ModelSource, load_model_source
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    m = load_manifest(manifest)
    m.data.path = str(workdir / m.data.path)
    ours = load_model_source(ModelSource(data_dir=workdir / "runs/local-bpe-demo/node-0",
                                         manifest=m)).build()
    ids = np.fromfile(val_shard, dtype=np.uint16)[:4 * 128].astype(np.int64)
    tokens = torch.from_numpy(ids).view(4, 128)
    with torch.no_grad():
        difference = (ours(tokens) - theirs(tokens).logits).abs().max().item()
        torch.manual_seed(0)
        prompt = tokenizer(PROMPT, return_tensors="pt")
        sampled = theirs.generate(**prompt, do_sample=True, max_new_tokens=40)
    return {"class": type(theirs).__name__,
            "parameters": sum(p.numel() for p in theirs.parameters()),
            "max_abs_logits_difference_fp32": difference,
            "transformers_generate_text": tokenizer.decode(sampled[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="inner steps per node")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data_to_model.json")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--workdir", type=Path, help="resume in a kept work directory")
    parser.add_argument("--perplexity-tokens", type=int, default=16384,
                        help="validation tokens for `perplexity` (0: the whole shard)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="data-to-model-"))
    data, manifest = Path("data/stdlib-bpe4k"), Path("runs/bpe-demo.toml")
    progress = workdir / "progress.json"
    done = json.loads(progress.read_text()) if progress.exists() else {}
    result: dict = {"workdir": str(workdir), "commands": []}

    def step(*command: str) -> str:
        line = "lowcomm-node " + " ".join(command)
        if line not in done:
            stdout, seconds = run(workdir, *command)
            done[line] = {"stdout": stdout, "wall_s": round(seconds, 1)}
            progress.write_text(json.dumps(done, indent=1))
        result["commands"].append({"command": line, "wall_s": done[line]["wall_s"]})
        print(f"{done[line]['wall_s']:7.1f} s  {line}", flush=True)
        return done[line]["stdout"]

    step("prepare-data", "--stdlib", "--vocab-size", str(args.vocab_size), "--out", str(data))
    result["dataset"] = json.loads((workdir / data / "dataset.json").read_text())
    step("init-swarm", "--id", "bpe-demo", "--data", str(data), "--out", str(manifest),
         "--set", "protocol.inner_steps=25", "--set", "train.eval_every=25")
    step("local-swarm", "--manifest", str(manifest), "--nodes", "2", "--max-steps",
         str(args.steps))
    result["rounds"] = {f"node-{i}": round_losses(workdir / f"runs/local-bpe-demo/node-{i}")
                        for i in range(2)}
    export = Path("exports/bpe-demo")
    step("export", "--data-dir", "runs/local-bpe-demo/node-0", "--manifest", str(manifest),
         "--out", str(export))
    result["transformers"] = compare_logits(workdir, workdir / export, workdir / manifest,
                                            workdir / data / "val-00000.bin")
    result["generate_text"] = step("generate", "--export", str(export), "--prompt", PROMPT,
                                   "--max-new-tokens", "60")
    result["perplexity"] = json.loads(step(
        "perplexity", "--data-dir", "runs/local-bpe-demo/node-0", "--manifest", str(manifest),
        "--file", str(data / "val-00000.bin"), "--max-tokens", str(args.perplexity_tokens),
        "--json"))
    args.out.write_text(json.dumps(result, indent=1))
    if not args.keep:
        shutil.rmtree(workdir)
    print(json.dumps({k: result[k] for k in ("transformers", "perplexity")}, indent=1))
    print(result["generate_text"])


if __name__ == "__main__":
    main()
