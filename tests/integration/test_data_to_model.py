"""Issue 23 end to end, on real daemons: prepare-data (a BPE trained on part of the embedded
corpus), a swarm manifest pinning it, two `join` processes training on the shards for a few
NoLoCo rounds, a third node with another tokenizer refused in one sentence, then export, load
with transformers, and `generate` printing text."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("tokenizers", reason="prepare-data needs the hf extra (.ci/setup installs it)")
transformers = pytest.importorskip("transformers", reason=".ci/setup installs the extra")

from node.config.manifest import load_manifest  # noqa: E402
from node.data.corpus import stdlib_dir  # noqa: E402
from node.data.shards import pinned_data_settings  # noqa: E402
from node.ops.model_source import ModelSource, load_model_source  # noqa: E402
from tests.swarm_harness import small_manifest  # noqa: E402

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only
STDLIB_PARTS = ("json", "email", "logging", "urllib", "http", "xml")  # about 1.5 MB of Python


def cli(*args: str, timeout: float = 240) -> str:
    done = subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(900)  # two preparations, three daemons, four CLI runs, transformers
def test_prepared_shards_train_in_a_swarm_and_export_to_transformers(harness_factory, tmp_path):
    inputs = [arg for part in STDLIB_PARTS for arg in ("--input", str(stdlib_dir() / part))]
    data, other = tmp_path / "data", tmp_path / "other-tokenizer"
    cli("prepare-data", *inputs, "--out", str(data), "--vocab-size", "512", "--val-fraction", "0.2",
        "--shard-tokens", "100000")
    cli("prepare-data", *inputs[:4], "--out", str(other), "--vocab-size", "512",
        "--val-fraction", "0.2")

    m = small_manifest("data-demo", "noloco", inner_steps=10)
    for key, value in pinned_data_settings(data).items():
        setattr(m.data, key, value)
    m.train.eval_every = 10
    harness = harness_factory(m)
    nodes = harness.start(2, timeout=240)
    for node in nodes:
        node.wait_rounds(3, timeout=240)
    # a pair may miss the first rounds on a loaded machine: wait for one swap, not for luck
    nodes[0].wait_for(lambda ev: any(e["event"] == "round" and e.get("partner") for e in ev),
                      240, "a round with a partner")
    for node in nodes:
        assert harness.stop(node) == 0
    rounds = [[(r["round"], round(r["val_loss"], 3)) for r in node.events("round")]
              for node in nodes]
    print("validation loss by round:", rounds)
    assert all(r[-1][1] < r[0][1] for r in rounds), rounds  # they learnt from the shards
    assert any(r.get("partner") for r in nodes[0].events("round"))  # and swapped

    # A member whose data.path holds another tokenizer: same manifest digest (the path is
    # the machine's own), refused before it joins, naming the tokenizer and the pin.
    stranger = harness.start_node(2, peers=[], extra=["--set", f'data.path="{other}"'])
    assert stranger.process.wait(timeout=120) == 1
    log = stranger.log_tail(5)
    assert "other-tokenizer/tokenizer.json' (digest" in log and \
        "is not the one the manifest pins (data.tokenizer_digest" in log, log

    export = tmp_path / "export"
    cli("export", "--data-dir", str(nodes[0].data_dir), "--manifest", str(harness.manifest_path),
        "--out", str(export))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    manifest = load_manifest(harness.manifest_path)
    ours = load_model_source(ModelSource(data_dir=nodes[0].data_dir, manifest=manifest)).build()
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    tokens = tokenizer("def load(fp, *, cls=None):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        difference = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"max abs logits difference, φ of node 0: {difference:.3g}")
    assert difference < 1e-4

    text = cli("generate", "--export", str(export), "--prompt", "def ", "--max-new-tokens", "30")
    print("generated:", text)
    assert text.startswith("def ") and len(text) > len("def ") + 10
    ppl = cli("perplexity", "--data-dir", str(nodes[0].data_dir), "--manifest",
              str(harness.manifest_path), "--file", str(data / "val-00000.bin"))
    print(ppl)
    assert "perplexity" in ppl
