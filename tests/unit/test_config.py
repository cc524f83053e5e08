import pytest

from node.config.schema import ConfigError, describe, load_config, parse_override, to_toml
from node.train.model import build_model, count_parameters


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.model.preset == "tiny" and cfg.data.source == "stdlib"


@pytest.mark.parametrize("override, fragment", [
    ("train.lrr=1", "unknown config key 'train.lrr': did you mean 'train.lr'?"),
    ("trian.lr=1", "unknown config section 'trian'"),
    ("train.steps=\"many\"", "config key 'train.steps' has the wrong type: got 'many', expected an integer"),
    ("train.steps=1.5", "expected an integer"),
    ("model.tie_embeddings=1", "expected true or false"),
    ("train.lr=-1", "config key 'train.lr' = -1.0 is out of range: it must be > 0.0"),
    ("train.lr=nan", "expected a number"),
    ("train.beta1=1.5", "out of range: it must be <= 1.0"),
    ("data.source=\"web\"", "config key 'data.source' = 'web' is not allowed: choose one of"),
    ("model.n_heads=7", "does not fit model.dim = 192"),
    ("train.tokens_per_step=1000", "is not a multiple of micro_batch_size * seq_len = 2048"),
    ("model=\"huge\"", "model preset 'huge' does not exist: choose one of large, medium, small, tiny"),
])
def test_bad_values_are_refused_naming_key_value_and_allowed(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert fragment in str(err.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*nope.toml' was not found"):
        load_config(tmp_path / "nope.toml")


def test_invalid_toml_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model = "small"\n[train]\nsteps = 7\nlr = 1e-3\n')
    cfg = load_config(path, ["train.steps=9", "node.data_dir=\"/tmp/x\""])
    assert (cfg.model.dim, cfg.train.steps, cfg.train.lr, cfg.node.data_dir) == (768, 9, 1e-3, "/tmp/x")
    cfg = load_config(path, ["model.preset=\"tiny\"", "model.dim=96", "model.n_heads=4"])
    assert (cfg.model.dim, cfg.model.n_layers) == (96, 4)


def test_override_syntax():
    assert parse_override("train.lr=3e-4") == ("train.lr", 3e-4)
    assert parse_override("node.data_dir=runs/a") == ("node.data_dir", "runs/a")
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        parse_override("train.lr")


def test_printed_config_loads_back(tmp_path):
    cfg = load_config(overrides=["train.steps=5"])
    path = tmp_path / "printed.toml"
    path.write_text(to_toml(cfg.to_dict()))
    assert load_config(path) == cfg


def test_every_key_is_documented():
    rows = describe()
    assert len(rows) > 30 and all(help_text for *_, help_text in rows)


@pytest.mark.parametrize("preset, vocab, low, high", [
    ("tiny", 256, 1e6, 3e6), ("small", 32000, 110e6, 140e6),
    ("medium", 32000, 1.2e9, 1.4e9), ("large", 32000, 6.5e9, 7e9)])
def test_model_presets_have_the_paper_sizes(preset, vocab, low, high):
    cfg = load_config(overrides=[f'model="{preset}"'])
    n = count_parameters(build_model(cfg.model, vocab, "meta"))
    assert low <= n <= high
