"""Typed, validated configuration: TOML files in configs/, any value overridable from the CLI.

A config is a tree of dataclasses. Every field carries its allowed range or choices in its
metadata, so one validator checks every section: an unknown key, a wrong type or an
out-of-range value is refused before anything starts, with a message naming the key, the bad
value and what is allowed. Values are data, never code: TOML is parsed, nothing is executed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
MODEL_PRESET_DIR = CONFIG_DIR / "models"


DEVICE = re.compile(r"auto|cuda|cuda:\d+|mps|cpu")  # train.device


class ConfigError(ValueError):
    """A configuration problem, phrased as one sentence that says what to change."""


def spec(default: Any, help: str, *, min: float | None = None, max: float | None = None,
         min_exclusive: bool = False, choices: tuple | None = None) -> Any:
    """A dataclass field with its documentation and bounds kept beside it."""
    meta = {"help": help, "min": min, "max": max, "min_exclusive": min_exclusive, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    preset: str = spec("tiny", "name of the preset in configs/models/ these values started from")
    dim: int = spec(192, "width of the residual stream", min=8, max=65536)
    n_layers: int = spec(4, "number of transformer blocks", min=1, max=1024)
    n_heads: int = spec(6, "attention heads; dim must be divisible by it", min=1, max=1024)
    ffn_hidden: int = spec(512, "hidden width of the SwiGLU feed-forward", min=1, max=1 << 20)
    max_seq_len: int = spec(1024, "longest sequence the rotary table covers", min=8, max=1 << 20)
    vocab_size: int = spec(0, "vocabulary size; 0 takes it from the data", min=0, max=1 << 24)
    rope_theta: float = spec(10000.0, "rotary embedding base", min=1.0, min_exclusive=False)
    norm_eps: float = spec(1e-5, "RMSNorm epsilon", min=0.0, max=1.0, min_exclusive=True)
    tie_embeddings: bool = spec(False, "share the input embedding with the output projection")


@dataclass
class DataConfig:
    source: str = spec("stdlib", "stdlib: this interpreter's standard library source; text: a "
                       "directory of text files; tokens: nanoGPT-style train.bin/val.bin",
                       choices=("stdlib", "text", "tokens"))
    path: str = spec("", "directory of the data for source = text or tokens")
    token_dtype: str = spec("uint16", "dtype of .bin token files", choices=("uint16", "uint32"))
    vocab_size: int = spec(0, "vocabulary of the token files (required for source = tokens)",
                           min=0, max=1 << 24)
    seq_len: int = spec(128, "tokens per training sequence", min=8, max=1 << 20)
    val_fraction: float = spec(0.02, "share of files held out for validation (by path hash)",
                               min=0.0, max=0.5, min_exclusive=True)
    # Pins of `lowcomm-node prepare-data`'s output (node/data/shards.py): "" pins nothing
    tokenizer_digest: str = spec("", "source = tokens: BLAKE2b-256 of the tokenizer.json in "
                                 "data.path that every member must use (\"\": not pinned)")
    shards_digest: str = spec("", "source = tokens: the digest of the token shards in data.path "
                              "(dataset.json's shards_digest; \"\": not pinned)")


@dataclass
class TrainConfig:
    steps: int = spec(600, "inner optimizer steps to run", min=1, max=1 << 40)
    lr: float = spec(3e-3, "peak learning rate of AdamW", min=0.0, max=10.0, min_exclusive=True)
    min_lr_ratio: float = spec(0.1, "cosine decay floor as a fraction of lr", min=0.0, max=1.0)
    warmup_steps: int = spec(50, "linear warm-up steps", min=0, max=1 << 40)
    decay_steps: int = spec(0, "length of the cosine schedule; 0 means train.steps",
                            min=0, max=1 << 40)
    weight_decay: float = spec(0.0, "AdamW weight decay (0 is the NoLoCo paper's Adam)",
                               min=0.0, max=10.0)
    beta1: float = spec(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = spec(0.95, "AdamW beta2", min=0.0, max=1.0)
    grad_clip: float = spec(1.0, "clip gradients to this global norm; 0 disables", min=0.0)
    micro_batch_size: int = spec(16, "sequences per forward/backward pass", min=1, max=1 << 20)
    tokens_per_step: int = spec(2048, "tokens per optimizer step; a multiple of "
                                "micro_batch_size * seq_len (the rest is accumulation)",
                                min=1, max=1 << 40)
    eval_every: int = spec(100, "validate every N steps; 0 only at the end", min=0)
    eval_batches: int = spec(8, "validation batches per evaluation", min=1, max=100000)
    log_every: int = spec(10, "print a progress line every N steps", min=1)
    checkpoint_every: int = spec(100, "write a checkpoint every N steps; 0 only at the end", min=0)
    seed: int = spec(0, "seed for initial weights and, with the identity, the batch stream", min=0)
    threads: int = spec(0, "torch CPU threads; 0 keeps torch's default", min=0, max=4096)
    min_step_seconds: float = spec(0.0, "pad every inner step to at least this wall time, idle "
                                   "(caps the duty cycle of a shared GPU or CPU); 0 disables",
                                   min=0.0, max=3600.0)
    device: str = spec("auto", "auto picks cuda, then mps, then cpu; cuda:N one GPU of several "
                       "(one daemon per GPU: join --gpu N)")
    compile: str = spec("auto", "torch.compile the model's forward and backward: on, off, or auto "
                        "(on CUDA only); eager where compilation is unavailable or fails",
                        choices=("auto", "on", "off"))
    precision: str = spec("auto", "auto: bf16 on CUDA compute capability >= 8.0, fp16 with loss "
                          "scaling below it, fp32 off CUDA; or bf16, fp16, fp32",
                          choices=("auto", "bf16", "fp16", "fp32"))
    micro_batch_probe: str = spec("auto", "find the largest micro-batch (an even split of "
                                  "tokens_per_step) that fits the device at start: on, off, or "
                                  "auto (on CUDA only); off keeps micro_batch_size",
                                  choices=("auto", "on", "off"))
    activation_checkpointing: bool = spec(False, "keep only each block's input during the "
                                          "forward pass and recompute the rest in the backward "
                                          "one: a step's activations shrink to one block's, for "
                                          "about a third more compute; the same gradients")


@dataclass
class NodeConfig:
    data_dir: str = spec("runs/node", "where the identity key, checkpoints and logs live")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    node: NodeConfig = field(default_factory=NodeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- validation

_TYPE_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"),
               str: ("a string", "strings"), bool: ("true or false", "booleans")}


def _type_name(tp: Any, plural: bool = False) -> str:
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0], plural=True)}"
    return _TYPE_NAMES[tp][plural]


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Checks one value against its annotated type; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' has the wrong type: got {value!r}, "
                              f"expected {_type_name(tp)}")
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            ok = math.isfinite(value)
    elif tp is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - only the types above are used in the config tree
        raise TypeError(f"unsupported config type {tp}")
    if not ok:
        raise ConfigError(f"config key '{key}' has the wrong type: got {value!r}, "
                          f"expected {_type_name(tp)}")
    return value


def _check_bounds(key: str, value: Any, meta: dict) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"config key '{key}' = {value!r} is not allowed: choose one of {allowed}")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
        op = ">" if meta.get("min_exclusive") else ">="
        raise ConfigError(f"config key '{key}' = {value!r} is out of range: it must be {op} {lo}"
                          + (f" and <= {hi}" if hi is not None else ""))
    if hi is not None and value > hi:
        raise ConfigError(f"config key '{key}' = {value!r} is out of range: it must be <= {hi}")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build_section(cls: type, values: dict[str, Any], prefix: str, base: Any = None) -> Any:
    """Builds one dataclass section from a dict, refusing unknown keys and bad values."""
    fields, hints = _fields(cls), _hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        close = difflib.get_close_matches(unknown[0], fields, n=1)
        hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}': {hint}allowed keys in "
                          f"[{prefix.rstrip('.') or 'top level'}] are {', '.join(sorted(fields))}")
    obj = base if base is not None else cls()
    for name, value in values.items():
        key = prefix + name
        checked = _coerce(key, value, hints[name])
        _check_bounds(key, checked, fields[name].metadata)
        setattr(obj, name, checked)
    return obj


def _check_cross_fields(cfg: Any) -> None:
    """Rules that involve more than one key."""
    m, d, t = cfg.model, cfg.data, cfg.train
    if m.dim % m.n_heads or (m.dim // m.n_heads) % 2:
        raise ConfigError(f"config key 'model.n_heads' = {m.n_heads} does not fit model.dim = "
                          f"{m.dim}: dim / n_heads must be a whole, even number")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"config key 'data.seq_len' = {d.seq_len} is longer than "
                          f"model.max_seq_len = {m.max_seq_len}: lower it or raise max_seq_len")
    if not DEVICE.fullmatch(t.device):
        raise ConfigError(f"config key 'train.device' = {t.device!r} is not allowed: choose one of "
                          f"'auto', 'cuda', 'cuda:N' (a GPU's index), 'mps', 'cpu'")
    micro = t.micro_batch_size * d.seq_len
    if t.tokens_per_step % micro:
        raise ConfigError(f"config key 'train.tokens_per_step' = {t.tokens_per_step} is not a "
                          f"multiple of micro_batch_size * seq_len = {micro}")
    if d.source in ("text", "tokens") and not d.path:
        raise ConfigError(f"config key 'data.path' is empty but data.source = '{d.source}' "
                          f"needs it: set it to the directory holding your data")
    if d.source != "tokens" and (d.tokenizer_digest or d.shards_digest):
        raise ConfigError(f"config key 'data.tokenizer_digest' or 'data.shards_digest' is set "
                          f"but data.source = '{d.source}' has no tokenizer or shards: set "
                          f"data.source = 'tokens' or clear the digests")
    if d.source == "tokens" and d.vocab_size == 0:
        raise ConfigError("config key 'data.vocab_size' is 0 but data.source = 'tokens' needs "
                          "the vocabulary size of the token files: set it")


# --------------------------------------------------------------------------- loading

def read_toml(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' was not found: check the path "
                          f"(presets live in {CONFIG_DIR})")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML ({exc}): fix the syntax") from None


def model_preset(name: str) -> dict[str, Any]:
    path = MODEL_PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.toml")))
        raise ConfigError(f"model preset '{name}' does not exist: choose one of {known}")
    values = read_toml(path)
    values.setdefault("preset", name)
    return values


def parse_override(text: str) -> tuple[str, Any]:
    """'train.lr=3e-4' -> ('train.lr', 0.0003). Values use TOML syntax; bare words are strings."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.key=value "
                          f"(for example train.steps=600)")
    key, raw = (s.strip() for s in text.split("=", 1))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def nest_overrides(overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in overrides:
        parts = key.split(".")
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{key}' conflicts with another override")
        node[parts[-1]] = value
    return tree


def build_config(layers: list[dict[str, Any]], cls: type = Config) -> Any:
    """Applies layers of plain values (file, then overrides) on the defaults, validating each."""
    cfg = cls()
    sections = _fields(cls)
    for layer in layers:
        unknown = sorted(set(layer) - set(sections))
        if unknown:
            raise ConfigError(f"unknown config section '{unknown[0]}': allowed sections are "
                              f"{', '.join(sorted(sections))}")
        for name, values in layer.items():
            section_cls = _hints(cls)[name]
            if name == "model" and isinstance(values, str):
                values = model_preset(values)
            elif name == "model" and isinstance(values, dict) and "preset" in values:
                values = {**model_preset(values["preset"]), **values}
            if not isinstance(values, dict):
                raise ConfigError(f"config section '{name}' must be a table of keys, "
                                  f"got {values!r}")
            build_section(section_cls, values, f"{name}.", getattr(cfg, name))
    if all(hasattr(cfg, section) for section in ("model", "data", "train")):
        _check_cross_fields(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls: type = Config):
    """Defaults <- TOML file <- 'section.key=value' overrides, all validated before use."""
    layers = []
    if path is not None:
        layers.append(read_toml(Path(path)))
    layers.append(nest_overrides([parse_override(o) for o in overrides]))
    return build_config(layers, cls)


def toml_value(value: Any) -> str:
    """One TOML value for the scalar and list types the config tree uses."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def to_toml(tree: dict[str, dict[str, Any]]) -> str:
    """Sections of flat values as TOML text (what `config` prints and init-swarm writes)."""
    lines = []
    for section, values in tree.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def describe(cls: type = Config) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every config key, for --help listings and docs."""
    rows = []
    for sname, stype in _hints(cls).items():
        for f in dataclasses.fields(stype):
            rows.append((f"{sname}.{f.name}", _type_name(_hints(stype)[f.name]),
                         getattr(stype(), f.name), f.metadata.get("help", "")))
    return rows

