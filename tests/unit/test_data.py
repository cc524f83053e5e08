import numpy as np
import pytest

from node.config.schema import DataConfig
from node.data.corpus import (BatchStream, DataError, load_corpus, stdlib_dir, stream_seed,
                       validation_batches)


@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus(DataConfig())


def test_stdlib_corpus_is_the_interpreters_own_source(stdlib_corpus):
    c = stdlib_corpus
    assert c.vocab_size == 256 and c.train.dtype == np.uint8
    assert len(c.train) > 5_000_000 and len(c.val) > 50_000
    assert "standard library of cpython" in c.description
    # the source of a stdlib module is in it, and no site-packages code is
    assert b"def namedtuple(" in c.train.tobytes() + c.val.tobytes()
    site = stdlib_dir() / "site-packages"
    if site.is_dir():
        assert b"import torch" not in c.train.tobytes()


def test_stdlib_corpus_is_reproducible(stdlib_corpus):
    again = load_corpus(DataConfig())
    assert again.digest == stdlib_corpus.digest
    assert np.array_equal(again.val, stdlib_corpus.val)


def test_text_directory_split_is_fixed_by_path(tmp_path):
    for i in range(200):
        (tmp_path / f"f{i:03d}.txt").write_text(f"file {i}\n" * 20)
    a = load_corpus(DataConfig(source="text", path=str(tmp_path), val_fraction=0.1))
    (tmp_path / "zzz-new.txt").write_text("late addition\n")
    b = load_corpus(DataConfig(source="text", path=str(tmp_path), val_fraction=0.1))
    assert a.digest != b.digest
    # the new file sorts last: the held-out files of the first load are held out again
    assert b.val.tobytes().startswith(a.val.tobytes())
    assert 0 < len(a.val) < len(a.train)


def test_empty_text_directory_is_explained(tmp_path):
    with pytest.raises(DataError, match="no text files were found"):
        load_corpus(DataConfig(source="text", path=str(tmp_path)))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files(tmp_path, dtype):
    rng = np.random.default_rng(0)
    rng.integers(0, 1000, 50_000).astype(dtype).tofile(tmp_path / "train.bin")
    rng.integers(0, 1000, 5_000).astype(dtype).tofile(tmp_path / "val.bin")
    c = load_corpus(DataConfig(source="tokens", path=str(tmp_path), token_dtype=dtype, vocab_size=1000))
    assert (len(c.train), len(c.val), c.vocab_size) == (50_000, 5_000, 1000)
    x, y = BatchStream(c.train, 16, 4, 1).next()
    assert x.shape == (4, 16) and int(x.max()) < 1000 and np.array_equal(x[:, 1:], y[:, :-1])


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    np.arange(0, 600, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(0, 100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match="holds token id 599, outside data.vocab_size = 512"):
        load_corpus(DataConfig(source="tokens", path=str(tmp_path), vocab_size=512))


def test_missing_token_file_is_named(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match="val.bin' is missing"):
        load_corpus(DataConfig(source="tokens", path=str(tmp_path), vocab_size=16))


def test_batch_stream_is_a_function_of_seed_and_position(stdlib_corpus):
    a = BatchStream(stdlib_corpus.train, 32, 4, seed=5)
    first = [a.next()[0] for _ in range(3)]
    b = BatchStream(stdlib_corpus.train, 32, 4, seed=5, position=2)
    assert np.array_equal(b.next()[0], first[2])
    other = BatchStream(stdlib_corpus.train, 32, 4, seed=6).next()[0]
    assert not np.array_equal(other, first[0])


def test_each_identity_gets_its_own_stream():
    seeds = {stream_seed(bytes([i]) * 32, 0) for i in range(100)}
    assert len(seeds) == 100
    assert stream_seed(b"k" * 32, 0) != stream_seed(b"k" * 32, 1)


def test_validation_batches_are_fixed(stdlib_corpus):
    a = [x for x, _ in validation_batches(stdlib_corpus.val, 64, 4, 3)]
    b = [x for x, _ in validation_batches(stdlib_corpus.val, 64, 4, 3)]
    assert len(a) == 3 and all(np.array_equal(x, y) for x, y in zip(a, b))
