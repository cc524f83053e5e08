"""export, generate and perplexity: a tiny model exported and loaded by transformers computes
the same logits as ours (max abs difference < 1e-4 in fp32), and the sources they read."""

import json
import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors", reason="export needs the hf extra (.ci/setup installs it)")
pytest.importorskip("tokenizers", reason="export needs the hf extra (.ci/setup installs it)")

from node.config.manifest import Manifest  # noqa: E402
from node.config.schema import Config  # noqa: E402
from node.data.corpus import Corpus, DataError  # noqa: E402
from node.data.tokenizer import byte_tokenizer  # noqa: E402
from node.ops.export import export_model  # noqa: E402
from node.ops.generate import SamplingSettings, perplexity, sample  # noqa: E402
from node.ops.model_source import ModelSource, load_model_source  # noqa: E402
from node.train.checkpoint import CheckpointStore, decode  # noqa: E402
from node.train.standalone import checkpoint_state  # noqa: E402
from node.train.trainer import InnerTrainer  # noqa: E402

LOGITS_TOLERANCE = 1e-4  # issue 23: fp32
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only: never the network


def tiny_config(tie: bool) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.n_heads, m.n_layers, m.ffn_hidden, m.max_seq_len = 48, 4, 2, 96, 64
    m.rope_theta, m.norm_eps, m.tie_embeddings = 500.0, 1e-6, tie  # not the defaults: both travel
    cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.tokens_per_step = 32, 4, 128
    cfg.train.device = "cpu"
    return cfg


def trained_checkpoint(tmp_path, tie: bool):
    """A real standalone checkpoint (bytes vocabulary) after two real steps, with the norm
    weights moved off 1 so that a wrong mapping of them shows in the logits."""
    cfg = tiny_config(tie)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, 20_000).astype(np.uint8)
    corpus = Corpus(tokens[:18_000], tokens[18_000:], 256, "test", "random bytes")
    trainer = InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len, 1, torch.device("cpu"))
    trainer.train_step()
    trainer.train_step()
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = CheckpointStore(tmp_path / "run" / "checkpoints").save(
        checkpoint_state(cfg, trainer, corpus.digest), trainer.step)
    return path, trainer.model.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_computes_our_logits(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    path, ours = trained_checkpoint(tmp_path, tie)
    out = export_model(load_model_source(ModelSource(checkpoint=path)), tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"max abs logits difference (fp32, tie={tie}): {difference:.3g}")
    assert difference < LOGITS_TOLERANCE
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("hé").input_ids == list("hé".encode())  # the bytes tokenizer, exported


def test_an_export_reads_back_to_the_same_weights_and_samples(tmp_path):
    path, ours = trained_checkpoint(tmp_path, tie=False)
    out = export_model(load_model_source(ModelSource(checkpoint=path)), tmp_path / "export")
    back = load_model_source(ModelSource(export=out)).build()
    for (name, a), (_, b) in zip(ours.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name
    settings = SamplingSettings(max_new_tokens=12, temperature=0.9, top_k=20, seed=3)
    assert sample(back, [100, 101], settings) == sample(ours, [100, 101], settings)
    lowcomm = json.loads((out / "lowcomm.json").read_text())
    assert lowcomm["trained_on_bytes"] and "standalone" in lowcomm["source"]


def test_greedy_sampling_matches_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    path, ours = trained_checkpoint(tmp_path, tie=False)
    out = export_model(load_model_source(ModelSource(checkpoint=path)), tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = list(b"def ")
    expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert sample(ours, prompt, SamplingSettings(max_new_tokens=10, temperature=0)) == expected


def test_perplexity_of_a_uniform_model_is_the_vocabulary(tmp_path):
    path, _ = trained_checkpoint(tmp_path, tie=False)
    model = load_model_source(ModelSource(checkpoint=path)).build()
    with torch.no_grad():
        model.embed.weight.zero_()  # every logit 0: p = 1/256 for every token
    ids = np.random.default_rng(0).integers(0, 256, 1000)
    result = perplexity(model, ids, context=48)
    assert result.tokens == 999 and math.isclose(result.perplexity, 256, rel_tol=1e-5)


def swarm_checkpoint(tmp_path, protocol: str = "noloco"):
    """A swarm node's checkpoint as node/daemon/daemon.py writes it: θ in the trainer, the
    protocol's own state_dict (φ inside) as the policy's, the manifest named only by digest."""
    from protocol.codecs.cast import IdentityCodec
    from protocol.dilocox import DiLoCoX
    from protocol.noloco import NoLoCo
    m = Manifest()
    cfg = tiny_config(False)
    m.model, m.data, m.protocol.name = cfg.model, cfg.data, protocol
    theta = {n: torch.randn(p.shape) for n, p in
             InnerTrainer(cfg.model, cfg.train, Corpus(np.zeros(5000, np.uint8),
                          np.zeros(500, np.uint8), 256, "z", "zeros"), 32, 1,
                          torch.device("cpu")).model.named_parameters()}
    phi = {n: t + 1 for n, t in theta.items()}
    policy = ({"noloco": NoLoCo(phi).state_dict()} if protocol == "noloco"
              else {"dilocox": DiLoCoX(phi, IdentityCodec(), "me").state_dict()})
    state = {"format": 1, "manifest": m.digest, "corpus_digest": "z",
             "trainer": {"model": theta}, "policy": policy}
    return CheckpointStore(tmp_path / "node" / "checkpoints").save(state, 50), m, theta, phi


@pytest.mark.parametrize("protocol", ["noloco", "dilocox"])
def test_a_swarm_checkpoint_exports_phi_by_default_and_theta_on_request(tmp_path, protocol):
    path, manifest, theta, phi = swarm_checkpoint(tmp_path, protocol)
    outer = load_model_source(ModelSource(data_dir=tmp_path / "node", manifest=manifest))
    fast = load_model_source(ModelSource(checkpoint=path, manifest=manifest, weights="theta"))
    for name in phi:
        assert torch.equal(outer.weights[name], phi[name]), name
        assert torch.equal(fast.weights[name], theta[name]), name
    assert f"({protocol}, φ)" in outer.description


def test_a_swarm_checkpoint_needs_its_own_manifest(tmp_path):
    path, manifest, _, _ = swarm_checkpoint(tmp_path)
    with pytest.raises(DataError, match="written by a swarm node: name its manifest with --swarm"):
        load_model_source(ModelSource(checkpoint=path))
    manifest.protocol.inner_steps += 1
    with pytest.raises(DataError, match=r"was written under manifest [0-9a-f]+, but 'local' has "
                                        r"digest [0-9a-f]+: give the manifest the node ran with"):
        load_model_source(ModelSource(checkpoint=path, manifest=manifest))


def test_export_refuses_a_non_empty_directory_and_a_tokenizer_that_does_not_fit(tmp_path):
    path, _ = trained_checkpoint(tmp_path, tie=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    loaded = load_model_source(ModelSource(checkpoint=path))
    with pytest.raises(DataError, match="'.*busy' exists and is not empty: choose a new"):
        export_model(loaded, tmp_path / "busy")
    big = tmp_path / "big.json"
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(0x4E00 + i): i for i in range(300)}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=chr(0x4E00))).save(str(big))
    loaded = load_model_source(ModelSource(checkpoint=path, tokenizer=big))
    with pytest.raises(DataError, match="has 300 tokens, more than the model's 256"):
        export_model(loaded, tmp_path / "out")


def test_export_refuses_a_tokenizer_other_than_the_manifests(tmp_path):
    path, manifest, _, _ = swarm_checkpoint(tmp_path)
    tokenizer = tmp_path / "tokenizer.json"
    byte_tokenizer().save(str(tokenizer))
    manifest.data.source, manifest.data.path = "tokens", str(tmp_path)
    manifest.data.vocab_size, manifest.data.tokenizer_digest = 256, "ab" * 32
    path = CheckpointStore(tmp_path / "node" / "checkpoints").save(
        {**decode(path.read_bytes(), path.name), "manifest": manifest.digest}, 60)
    loaded = load_model_source(ModelSource(checkpoint=path, manifest=manifest))
    with pytest.raises(DataError, match=r"the tokenizer '.*tokenizer.json' is not the one the "
                                        r"manifest pins \(data.tokenizer_digest = abababab"):
        export_model(loaded, tmp_path / "out")


def test_the_byte_tokenizer_is_the_identity_on_bytes():
    text = "tab\t, nul\x00, é, €, 🙂"
    tokenizer = byte_tokenizer()
    assert tokenizer.encode(text).ids == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
