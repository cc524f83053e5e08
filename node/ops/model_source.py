"""Where `export`, `generate` and `perplexity` take a model from: a checkpoint file, a node's data
directory (its newest readable checkpoint), or an export directory; and its tokenizer.

Which weights of a swarm node's checkpoint (`weights`):
- "outer" (default): the outer weights φ, what the swarm agrees on: NoLoCo's slow weights, or
  DiLoCoX's agreed state; a standalone `train` checkpoint has only θ, which is used;
- "theta": the node's fast weights θ (its live model, mid-round).
A swarm node's checkpoint names its manifest only by digest: the manifest itself (--swarm or
--manifest) supplies the model's shape, and must have that digest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from node.config.manifest import Manifest
from node.config.schema import Config, DataConfig, ModelConfig, build_config
from node.data.corpus import DataError
from node.data_dir import DataDir
from node.train.checkpoint import CheckpointStore, decode
from node.train.model import Decoder, build_model

WEIGHT_CHOICES = ("outer", "theta")
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class ModelSource:
    """What the operator named (exactly one of the first three)."""
    checkpoint: Path | None = None
    data_dir: Path | None = None
    export: Path | None = None
    manifest: Manifest | None = None  # needed for a swarm node's checkpoint
    weights: str = "outer"
    tokenizer: Path | None = None     # overrides the one the source implies


@dataclass
class LoadedModel:
    model_cfg: ModelConfig
    weights: dict[str, torch.Tensor]  # our parameter names, fp32, on the CPU
    data: DataConfig | None           # the data the model was trained on, when known
    tokenizer_path: Path | None       # None with data.source stdlib/text: raw bytes
    description: str

    @property
    def vocab_size(self) -> int:
        return self.weights["embed.weight"].shape[0]

    def build(self) -> Decoder:
        """Our decoder holding these weights, in eval mode."""
        model = build_model(self.model_cfg, self.vocab_size)
        params = dict(model.named_parameters())
        missing = sorted(set(params) - set(self.weights))
        wrong = [n for n, p in params.items() if n in self.weights
                 and self.weights[n].shape != p.shape]
        if missing or wrong:
            raise DataError(f"{self.description} does not fit the model its config describes "
                            f"(missing {missing[:3]}, wrong shape {wrong[:3]}): give the "
                            f"manifest the model was trained with")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.weights[name])
        return model.eval()


def _checkpoint_state(source: ModelSource) -> tuple[dict, str]:
    if source.checkpoint is not None:
        path = source.checkpoint
        if not path.is_file():
            raise DataError(f"checkpoint '{path}' does not exist: give a ckpt-*.pt file of a "
                            f"node's checkpoints/ directory")
        return decode(path.read_bytes(), path.name), f"checkpoint {path}"
    loaded = CheckpointStore(DataDir(source.data_dir).checkpoints).load_latest()
    if loaded is None:
        raise DataError(f"data directory '{source.data_dir}' holds no checkpoint: give the "
                        f"--data-dir a node ran with, or a --checkpoint file")
    return loaded.state, f"checkpoint {loaded.path}"


def _swarm_weights(state: dict, source: ModelSource) -> dict[str, torch.Tensor]:
    if source.weights == "theta":
        return state["trainer"]["model"]
    policy = state["policy"]
    if "noloco" in policy:
        return policy["noloco"]["slow_weights"]
    return policy["dilocox"]["outer"]["slow_weights"]


def _from_checkpoint(source: ModelSource) -> LoadedModel:
    state, where = _checkpoint_state(source)
    if "config" in state:  # `lowcomm-node train`: the config travels with it, θ only
        cfg = build_config([state["config"]], Config)
        return LoadedModel(cfg.model, state["trainer"]["model"], cfg.data,
                           _data_tokenizer(cfg.data, source), f"{where} (standalone, θ)")
    m = source.manifest
    if m is None:
        raise DataError(f"{where} was written by a swarm node: name its manifest with --swarm "
                        f"ID or --manifest PATH")
    if state.get("manifest") != m.digest:
        raise DataError(f"{where} was written under manifest {state.get('manifest')}, but "
                        f"'{m.swarm.id}' has digest {m.digest}: give the manifest the node "
                        f"ran with")
    weights = _swarm_weights(state, source)
    which = "θ" if source.weights == "theta" else "φ"
    return LoadedModel(m.model, weights, m.data, _data_tokenizer(m.data, source),
                       f"{where} ({m.protocol.name}, {which})")


def _data_tokenizer(data: DataConfig, source: ModelSource) -> Path | None:
    if source.tokenizer is not None:
        return source.tokenizer
    if data.source != "tokens":
        return None  # bytes: node/data/tokenizer.py byte_tokenizer
    path = Path(data.path) / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"the model was trained on token files in '{data.path}', which hold no "
                        f"{TOKENIZER_FILE}: give the tokenizer with --tokenizer PATH")
    return path


def safetensors_torch():
    """safetensors' torch half, or one sentence on how to install it."""
    try:
        import safetensors.torch
    except ImportError:
        raise DataError("the 'safetensors' package is not installed: pip install "
                        "'lowcomm-node[hf]' (or pip install safetensors)") from None
    return safetensors.torch


def _from_export(directory: Path, source: ModelSource) -> LoadedModel:
    from node.ops.hf_layout import from_llama, model_config_from_llama
    load_file = safetensors_torch().load_file
    for name in (EXPORT_CONFIG, EXPORT_WEIGHTS):
        if not (directory / name).is_file():
            raise DataError(f"'{directory}' has no {name}: give a directory written by "
                            f"lowcomm-node export")
    cfg = model_config_from_llama(json.loads((directory / EXPORT_CONFIG).read_text()))
    tensors = {n: t.float() for n, t in load_file(directory / EXPORT_WEIGHTS).items()}
    tokenizer = source.tokenizer or directory / TOKENIZER_FILE
    return LoadedModel(cfg, from_llama(tensors, cfg), None, tokenizer, f"export {directory}")


def load_model_source(source: ModelSource) -> LoadedModel:
    given = [p for p in (source.checkpoint, source.data_dir, source.export) if p is not None]
    if len(given) != 1:
        raise DataError("give exactly one of --checkpoint FILE, --data-dir DIR (its newest "
                        "checkpoint) or --export DIR")
    if source.weights not in WEIGHT_CHOICES:
        raise DataError(f"--weights {source.weights!r} is not one of {', '.join(WEIGHT_CHOICES)}")
    if source.export is not None:
        return _from_export(source.export, source)
    loaded = _from_checkpoint(source)
    loaded.weights = {n: t.float().cpu() for n, t in loaded.weights.items()}
    return loaded


def load_source_tokenizer(loaded: LoadedModel):
    """The model's tokenizer object (raw bytes when it was trained on bytes), checked against
    the manifest's pin where there is one."""
    from node.data.tokenizer import byte_tokenizer, file_digest, load_tokenizer
    if loaded.tokenizer_path is None:
        return byte_tokenizer()
    pin = loaded.data.tokenizer_digest if loaded.data is not None else ""
    if pin and file_digest(loaded.tokenizer_path) != pin:
        raise DataError(f"the tokenizer '{loaded.tokenizer_path}' is not the one the manifest "
                        f"pins (data.tokenizer_digest = {pin[:16]}...): give the swarm's "
                        f"tokenizer.json with --tokenizer")
    tokenizer = load_tokenizer(loaded.tokenizer_path)
    if tokenizer.get_vocab_size(with_added_tokens=True) > loaded.vocab_size:
        raise DataError(f"the tokenizer '{loaded.tokenizer_path}' has "
                        f"{tokenizer.get_vocab_size(with_added_tokens=True)} tokens, more than "
                        f"the model's {loaded.vocab_size}: give the tokenizer it was trained with")
    return tokenizer
