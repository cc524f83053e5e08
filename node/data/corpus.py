"""Training data: the embedded corpus, user text or token files, and per-node batch streams.

The embedded default corpus is the running interpreter's own standard-library source (never
site-packages), read as bytes (vocabulary 256). Files are taken in sorted path order, so every
machine with the same Python version reads the same bytes, and a BLAKE2b digest of the corpus
lets two nodes tell whether they train on the same thing. A file belongs to the held-out
validation split when the hash of its relative path says so: the split is fixed, and does not
shift when a file is added elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from node.config.schema import DataConfig

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
FILE_SEPARATOR = b"\n\n"


class DataError(ValueError):
    """The data cannot be used; the message says what is wrong and what to do."""


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids (uint8, uint16 or uint32; memory-mapped for token files)
    val: np.ndarray
    vocab_size: int
    digest: str  # BLAKE2b of everything that defines the corpus
    description: str

    def summary(self) -> str:
        return (f"{self.description}: {len(self.train):,} train / {len(self.val):,} validation "
                f"tokens, vocabulary {self.vocab_size}, digest {self.digest[:16]}")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_validation(relpath: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(relpath.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < val_fraction


def text_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """The files under root, in the order of their relative paths' parts (as sorted(Path) has
    it). The walk never enters an excluded directory: the standard library's own tests and
    caches hold most of its entries, and listing them cost every node start 2 s."""
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        for name in names:
            path = Path(directory, name)
            if (suffixes is None or path.suffix in suffixes) and path.is_file():
                files.append(path)
    return sorted(files, key=lambda path: path.relative_to(root).parts)


def load_text_tree(root: Path, suffixes: tuple[str, ...] | None, val_fraction: float,
                   description: str) -> Corpus:
    """Reads every file under root as bytes, split into train and validation by path hash."""
    files = text_files(root, suffixes)
    if not files:
        raise DataError(f"no text files were found under '{root}': point data.path at a "
                        f"directory that holds your text files")
    digest = hashlib.blake2b(digest_size=32)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in files:
        rel = path.relative_to(root).as_posix()
        content = path.read_bytes()
        digest.update(rel.encode() + b"\0" + len(content).to_bytes(8, "big") + content)
        parts[is_validation(rel, val_fraction)].extend((content, FILE_SEPARATOR))
    train, val = (np.frombuffer(b"".join(parts[v]), dtype=np.uint8) for v in (False, True))
    if len(val) == 0 or len(train) == 0:
        raise DataError(f"the files under '{root}' gave an empty train or validation split: "
                        f"add more files or change data.val_fraction")
    return Corpus(train, val, 256, digest.hexdigest(), f"{description} ({len(files)} files)")


def load_token_files(root: Path, dtype: str, vocab_size: int) -> Corpus:
    """nanoGPT-style train.bin and val.bin: flat arrays of token ids, memory-mapped."""
    arrays = {}
    digest = hashlib.blake2b(f"{dtype}:{vocab_size}".encode(), digest_size=32)
    for split in ("train", "val"):
        path = root / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"token file '{path}' is missing: data.source = 'tokens' needs "
                            f"train.bin and val.bin in data.path")
        itemsize = np.dtype(dtype).itemsize
        if path.stat().st_size % itemsize or path.stat().st_size == 0:
            raise DataError(f"token file '{path}' has {path.stat().st_size} bytes, not a "
                            f"non-zero multiple of {itemsize}: is data.token_dtype right?")
        arr = np.memmap(path, dtype=dtype, mode="r")
        # One full pass: an id outside the vocabulary would index past the embedding table.
        top = int(arr.max())
        if top >= vocab_size:
            raise DataError(f"token file '{path}' holds token id {top}, outside "
                            f"data.vocab_size = {vocab_size}: set the right vocabulary size")
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "blake2b").digest())
        arrays[split] = arr
    return Corpus(arrays["train"], arrays["val"], vocab_size, digest.hexdigest(),
                  f"token files in {root}")


def load_corpus(cfg: DataConfig) -> Corpus:
    if cfg.source == "stdlib":
        version = f"{sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor}"
        return load_text_tree(stdlib_dir(), (".py",), cfg.val_fraction,
                              f"standard library of {version}")
    root = Path(cfg.path).expanduser()
    if not root.is_dir():
        raise DataError(f"data.path '{root}' is not a directory: point it at your data")
    if cfg.source == "text":
        return load_text_tree(root, None, cfg.val_fraction, f"text files in {root}")
    from node.data.shards import load_token_dir  # it builds on this module
    return load_token_dir(root, cfg)


def stream_seed(identity: bytes | str, seed: int) -> int:
    """A node's batch-stream seed: its identity (a public key) mixed with the run's seed."""
    raw = identity.encode() if isinstance(identity, str) else bytes(identity)
    h = hashlib.blake2b(raw + seed.to_bytes(8, "big"), digest_size=8, person=b"lcn-data")
    return int.from_bytes(h.digest(), "big")


class BatchStream:
    """Deterministic random batches: batch k depends only on (seed, k).

    So the stream's whole state is the counter `position`: a checkpoint stores it, and a resumed
    run draws exactly the batches the uninterrupted run would have.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 position: int = 0):
        if len(tokens) <= seq_len + 1:
            raise DataError(f"the training split has {len(tokens)} tokens, fewer than one "
                            f"sequence of {seq_len}: lower data.seq_len or add data")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.position = seed, position
        self._window = np.arange(seq_len + 1)

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        window = torch.from_numpy(self.tokens[starts[:, None] + self._window].astype(np.int64))
        return window[:, :-1], window[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch


def validation_batches(tokens: np.ndarray, seq_len: int, batch_size: int, count: int):
    """Fixed, evenly spaced windows of the validation split: the same on every node and call."""
    n = batch_size * count
    span = len(tokens) - seq_len - 1
    if span <= 0:
        raise DataError(f"the validation split has {len(tokens)} tokens, fewer than one "
                        f"sequence of {seq_len}: add data or raise data.val_fraction")
    starts = np.linspace(0, span - 1, num=n).astype(np.int64)
    window = np.arange(seq_len + 1)
    for i in range(count):
        chunk = torch.from_numpy(tokens[starts[i * batch_size:(i + 1) * batch_size, None]
                                        + window].astype(np.int64))
        yield chunk[:, :-1], chunk[:, 1:]
