"""prepare-data: shards and digests, resuming, the manifest's pins, and every bad input."""

import json
import random

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="prepare-data needs the hf extra (.ci/setup installs it)")

from node.cli import main  # noqa: E402
from node.config.schema import DataConfig  # noqa: E402
from node.data.corpus import DataError, load_corpus  # noqa: E402
from node.data.prepare import PrepareSettings, prepare  # noqa: E402
from node.data.shards import ShardedTokens, pinned_data_settings  # noqa: E402
from node.data.sources import SourceSpec  # noqa: E402
from node.data.tokenizer import file_digest, load_tokenizer, shard_dtype  # noqa: E402

WORDS = "alpha beta gamma delta lambda kappa omega sigma tau rho phi chi psi".split()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs") / "docs"
    rng = random.Random(0)
    for i in range(60):
        (root / f"part{i % 3}").mkdir(parents=True, exist_ok=True)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400)))
        (root / f"part{i % 3}" / f"doc{i:02d}.txt").write_text(f"# {i} é\n{text}\n")
    return root


def settings(out, inputs, **values):
    values.setdefault("vocab_size", 300)
    values.setdefault("val_fraction", 0.15)
    values.setdefault("shard_tokens", 2000)
    sources = SourceSpec(tuple(inputs), values.pop("json_field", None))
    return PrepareSettings(out=out, sources=sources, **values)


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


def test_shards_hold_the_documents_in_order_with_their_digests(tmp_path, docs):
    index = prepare(settings(tmp_path / "data", [docs]))
    out = tmp_path / "data"
    assert index["complete"] and index["dtype"] == "uint16"
    assert index["tokenizer"]["digest"] == file_digest(out / "tokenizer.json")
    for split in ("train", "val"):
        for entry in index["splits"][split]["shards"]:
            assert file_digest(out / entry["file"]) == entry["digest"]
    assert len(index["splits"]["train"]["shards"]) > 3 and index["splits"]["val"]["shards"]
    # decoding the training shards gives back the training documents, each ended by <|endoftext|>
    tokenizer = load_tokenizer(out / "tokenizer.json")
    corpus = load_corpus(DataConfig(source="tokens", path=str(out), vocab_size=300))
    assert corpus.digest == index["shards_digest"] and isinstance(corpus.train, ShardedTokens)
    text = tokenizer.decode(corpus.train[np.arange(len(corpus.train))].tolist(),
                            skip_special_tokens=False)
    documents = text.split("<|endoftext|>")
    assert documents[-1] == "" and len(documents) - 1 == index["sources"]["documents"]["train"]
    every = {p.read_text() for p in docs.rglob("*.txt")}
    assert set(documents[:-1]) <= every


def test_sharded_windows_straddle_shards():
    arrays = [np.arange(0, 5, dtype=np.uint16), np.arange(5, 12, dtype=np.uint16),
              np.arange(12, 13, dtype=np.uint16)]
    tokens = ShardedTokens(arrays)
    index = np.array([[3, 4, 5, 6], [11, 12, 0, 1]])
    assert len(tokens) == 13 and np.array_equal(tokens[index], index)


def test_interrupted_preparation_resumes_to_the_same_digests(tmp_path, docs, monkeypatch):
    whole = prepare(settings(tmp_path / "whole", [docs]))
    # Encode a few documents at a time (the default batch holds this whole corpus), so that
    # shards are written before the interruption; shard boundaries do not depend on it.
    monkeypatch.setattr("node.data.prepare.ENCODE_BATCH_BYTES", 1500)

    class CtrlC:  # what Ctrl-C does: a KeyboardInterrupt in the middle of tokenizing
        def __init__(self):
            self.phase, self.calls = "", 0

        def start(self, phase, total):
            self.phase = phase

        def advance(self, amount):
            self.calls += self.phase == "tokenizing"
            if self.calls == 40:
                raise KeyboardInterrupt

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        prepare(settings(out, [docs]), CtrlC())
    partial = json.loads((out / "dataset.json").read_text())
    kept = partial["splits"]["train"]["shards"]
    assert not partial["complete"] and 0 < len(kept) < len(whole["splits"]["train"]["shards"])
    kept_inode = (out / kept[0]["file"]).stat().st_ino
    (out / "train-00099.bin").write_bytes(b"\x01\x02")  # a shard written after the index was

    resumed = prepare(settings(out, [docs]))
    assert resumed["shards_digest"] == whole["shards_digest"]
    assert resumed["tokenizer"]["digest"] == whole["tokenizer"]["digest"]  # BPE is deterministic
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert (out / kept[0]["file"]).stat().st_ino == kept_inode  # kept, not rewritten


def test_a_given_tokenizer_and_json_lines(tmp_path, docs):
    first = prepare(settings(tmp_path / "a", [docs]))
    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "text": f"alpha beta {i} " * 30}) + "\n"
                             for i in range(80)))
    index = prepare(settings(tmp_path / "b", [lines], vocab_size=0, json_field="text",
                             tokenizer=tmp_path / "a" / "tokenizer.json"))
    assert index["tokenizer"]["digest"] == first["tokenizer"]["digest"]
    assert sum(index["sources"]["documents"].values()) == 80
    assert index["recipe"]["tokenizer"] == f"given {first['tokenizer']['digest']}"


def test_another_recipe_in_the_same_directory_is_refused(tmp_path, docs):
    prepare(settings(tmp_path / "data", [docs]))
    with pytest.raises(DataError, match=r"holds a preparation with another val_fraction .*"
                                        r"use another --out"):
        prepare(settings(tmp_path / "data", [docs], val_fraction=0.3))


def bad_input(tmp_path, case):
    """(settings, the words the error must hold) for each bad input of issue 23."""
    if case == "empty directory":
        (tmp_path / "empty").mkdir()
        return settings(tmp_path / "out", [tmp_path / "empty"]), ["'", "empty", "holds no files",
                                                                 "point --input"]
    if case == "not UTF-8":
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "good.txt").write_text("fine text\n")
        (tmp_path / "in" / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
        return settings(tmp_path / "out", [tmp_path / "in"]), ["latin1.txt", "is not UTF-8",
                                                              "0xe9", "convert it to UTF-8"]
    if case == "JSON line without the field":
        path = tmp_path / "docs.jsonl"
        path.write_text('{"text": "one"}\n{"body": "two"}\n')
        return (settings(tmp_path / "out", [path], json_field="text"),
                ["docs.jsonl' line 2", "no field 'text'", "its fields: body", "--json-field"])
    if case == "vocabulary too large for uint16":
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "a.txt").write_text("text\n")
        return (settings(tmp_path / "out", [tmp_path / "in"], vocab_size=70_000, dtype="uint16"),
                ["--vocab-size 70,000", "too large for uint16", "--dtype uint32"])
    if case == "a tokenizer.json that is not one":
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "a.txt").write_text("text\n")
        (tmp_path / "tok.json").write_text('{"model": "nothing"}')
        return (settings(tmp_path / "out", [tmp_path / "in"], vocab_size=0,
                         tokenizer=tmp_path / "tok.json"),
                ["tok.json' cannot be read by the tokenizers library", "give a tokenizer.json"])
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["empty directory", "not UTF-8", "JSON line without the field",
                                  "vocabulary too large for uint16",
                                  "a tokenizer.json that is not one"])
def test_bad_input_is_one_sentence_naming_the_file_or_setting_and_the_fix(tmp_path, case):
    s, words = bad_input(tmp_path, case)
    with pytest.raises(DataError) as caught:
        prepare(s)
    message = str(caught.value)
    assert all(w in message for w in words), message
    assert "\n" not in message and message.count(": ") >= 1


def test_the_cli_prints_the_sentence_and_exits_1(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["prepare-data", "--input", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "out"), "--vocab-size", "300"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("lowcomm-node: error: input directory")
    assert "Traceback" not in "\n".join(err)


def test_dtype_follows_the_vocabulary():
    assert shard_dtype(65_536) == "uint16" and shard_dtype(65_537) == "uint32"
    assert shard_dtype(100, "uint32") == "uint32"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, docs):
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(settings(out, [docs]))
    return out


def pinned(prepared, **changes):
    return DataConfig(**{**pinned_data_settings(prepared), **changes})


def test_pinned_data_loads(prepared):
    corpus = load_corpus(pinned(prepared))
    assert corpus.digest == pinned_data_settings(prepared)["shards_digest"]


def test_a_tokenizer_other_than_the_pinned_one_is_named(prepared, tmp_path):
    with pytest.raises(DataError, match=r"the tokenizer '.*tokenizer.json' \(digest [0-9a-f]{16}"
                                        r"\.\.\.\) is not the one the manifest pins "
                                        r"\(data.tokenizer_digest = 0000000000000000\.\.\.\): "
                                        r"prepare the data again with the swarm's tokenizer"):
        load_corpus(pinned(prepared, tokenizer_digest="0" * 64))


def test_shards_other_than_the_pinned_ones_are_named(prepared):
    with pytest.raises(DataError, match=r"the token shards in '.*' \(digest .*\) are not the ones "
                                        r"the manifest pins \(data.shards_digest = ffff"):
        load_corpus(pinned(prepared, shards_digest="f" * 64))


def test_an_altered_shard_is_caught_by_its_digest(tmp_path, docs):
    out = tmp_path / "data"
    prepare(settings(out, [docs]))
    shard = out / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="train-00001.bin' is missing or differs from its digest"):
        load_corpus(pinned_data_settings_config(out))


def pinned_data_settings_config(out):
    return DataConfig(**pinned_data_settings(out))


def test_unset_pins_keep_a_manifest_digest_and_a_pinned_path_is_local(prepared):
    from node.config.manifest import Manifest, load_manifest
    from node.config.schema import CONFIG_DIR
    local = load_manifest(CONFIG_DIR / "swarms" / "local.toml")
    assert "tokenizer_digest" not in local.agreed().get("data", {})  # older manifests' digests stand
    a, b = Manifest(), Manifest()
    for m, path in ((a, str(prepared)), (b, "/elsewhere/on/this/machine")):
        for key, value in pinned_data_settings(prepared).items():
            setattr(m.data, key, value)
        m.data.path = path
    assert a.digest == b.digest  # the shards are pinned: where they lie is the machine's own
    b.data.tokenizer_digest = "0" * 64
    assert a.digest != b.digest


def test_pins_need_token_data():
    from node.config.schema import ConfigError, load_config
    with pytest.raises(ConfigError, match="'data.tokenizer_digest' or 'data.shards_digest' is "
                                          "set but data.source = 'stdlib'"):
        load_config(None, ["data.tokenizer_digest=\"ab\""])


def test_one_large_text_file_is_cut_into_pieces_for_both_splits(tmp_path, monkeypatch):
    monkeypatch.setattr("node.data.sources.PIECE_CHARS", 2000)
    rng = random.Random(1)
    text = "".join(" ".join(rng.choice(WORDS) for _ in range(12)) + "\n" for _ in range(2000))
    (tmp_path / "book.txt").write_text(text)
    index = prepare(settings(tmp_path / "data", [tmp_path / "book.txt"], val_fraction=0.2))
    pieces = index["sources"]["documents"]
    assert pieces["train"] > 10 and pieces["val"] > 2
    corpus = load_corpus(DataConfig(**pinned_data_settings(tmp_path / "data")))
    tokenizer = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    decoded = [tokenizer.decode(split[np.arange(len(split))].tolist(), skip_special_tokens=False)
               for split in (corpus.train, corpus.val)]
    # pieces end at line ends, only the file's last piece is followed by <|endoftext|>
    assert sum(d.count("<|endoftext|>") for d in decoded) == 1
    assert sorted("".join(decoded).replace("<|endoftext|>", "").splitlines()) == \
        sorted(text.splitlines())
