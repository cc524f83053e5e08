"""Prepared token data on disk: shards, their index (dataset.json), digests, and the manifest's
pins on them.

A prepared directory (what `lowcomm-node prepare-data` writes) holds

    tokenizer.json             the tokenizer (node/data/tokenizer.py)
    train-00000.bin ...        token ids, flat, uint16 or uint32, documents separated by the
    val-00000.bin ...          end-of-text id; a shard ends at a document boundary
    dataset.json               the recipe, each shard's token count and BLAKE2b-256 digest

The shards' digest (`shards_digest`) is BLAKE2b-256 of the canonical JSON of the dtype and the
ordered shard digests of each split: one string that a swarm manifest pins
(data.shards_digest), next to the tokenizer's (data.tokenizer_digest). A node whose shards or
tokenizer differ from the pins is told which, in one sentence, before it trains.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from node.config.schema import DataConfig
from node.data.corpus import Corpus, DataError, load_token_files
from node.data.tokenizer import file_digest

INDEX_FILE = "dataset.json"
TOKENIZER_FILE = "tokenizer.json"
INDEX_FORMAT = 1
SPLITS = ("train", "val")


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.bin"


def shards_digest(dtype: str, digests: dict[str, list[str]]) -> str:
    """One digest for a whole shard set: its dtype and each split's shard digests, in order."""
    canonical = json.dumps({"dtype": dtype, **{s: digests[s] for s in SPLITS}},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=32).hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Temporary file, fsync, rename: `path` holds the old bytes or the new ones, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_index(root: Path) -> dict[str, Any] | None:
    path = root / INDEX_FILE
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"'{path}' is not a dataset index: delete '{root}' and run "
                        f"lowcomm-node prepare-data again") from None
    if index.get("format") != INDEX_FORMAT:
        raise DataError(f"'{path}' has format {index.get('format')!r}, this version reads "
                        f"{INDEX_FORMAT}: prepare the data again with this version")
    return index


def write_index(root: Path, index: dict[str, Any]) -> None:
    write_atomically(root / INDEX_FILE, json.dumps(index, indent=1, sort_keys=True).encode())


class ShardedTokens:
    """Several memory-mapped token files read as one flat array, for BatchStream and
    validation_batches (which index it with integer arrays). Nothing is copied into memory."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.offsets = np.cumsum([0, *(len(a) for a in arrays)])
        self.dtype = arrays[0].dtype

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        shard = np.searchsorted(self.offsets, index, side="right") - 1
        out = np.empty(index.shape, dtype=self.dtype)
        for s in np.unique(shard):  # windows may straddle two shards
            mask = shard == s
            out[mask] = self.arrays[s][index[mask] - self.offsets[s]]
        return out


def _open_shards(root: Path, split: str, entries: list[dict], dtype: str, vocab_size: int):
    arrays = []
    for entry in entries:
        path = root / entry["file"]
        if not path.is_file() or file_digest(path) != entry["digest"]:
            raise DataError(f"shard '{path}' is missing or differs from its digest in "
                            f"{INDEX_FILE}: run lowcomm-node prepare-data again with the same "
                            f"arguments to rewrite it")
        array = np.memmap(path, dtype=dtype, mode="r")
        if len(array) and int(array.max()) >= vocab_size:  # would index past the embedding
            raise DataError(f"shard '{path}' holds token id {int(array.max())}, outside the "
                            f"vocabulary of {vocab_size}: prepare the data again")
        arrays.append(array)
    if not arrays:
        raise DataError(f"'{root}' has no {split} shards: prepare the data again")
    return arrays[0] if len(arrays) == 1 else ShardedTokens(arrays)


def recorded_digest(index: dict[str, Any]) -> str:
    """The shards' digest from the index (each file is checked against its own when opened)."""
    return shards_digest(index["dtype"], {s: [e["digest"] for e in index["splits"][s]["shards"]]
                                          for s in SPLITS})


def load_prepared(root: Path, cfg: DataConfig, index: dict[str, Any]) -> Corpus:
    """A finished prepare-data directory as a Corpus; its digest is the shards' digest."""
    dtype, vocab = index["dtype"], index["tokenizer"]["vocab_size"]
    if cfg.token_dtype != dtype:
        raise DataError(f"data.token_dtype = '{cfg.token_dtype}' but the shards in '{root}' are "
                        f"{dtype}: set data.token_dtype = '{dtype}'")
    if cfg.vocab_size != vocab:
        raise DataError(f"data.vocab_size = {cfg.vocab_size} but the shards in '{root}' were "
                        f"made with a vocabulary of {vocab}: set data.vocab_size = {vocab}")
    splits = {s: _open_shards(root, s, index["splits"][s]["shards"], dtype, vocab)
              for s in SPLITS}
    return Corpus(splits["train"], splits["val"], vocab, recorded_digest(index),
                  f"prepared shards in {root}")


def check_tokenizer_pin(cfg: DataConfig, root: Path) -> None:
    """The manifest's data.tokenizer_digest against data.path/tokenizer.json."""
    if not cfg.tokenizer_digest:
        return
    path = root / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"the manifest pins data.tokenizer_digest = {cfg.tokenizer_digest[:16]}"
                        f"... but '{root}' has no {TOKENIZER_FILE}: prepare the data with the "
                        f"swarm's tokenizer (lowcomm-node prepare-data --tokenizer "
                        f"THE_SWARMS.json)")
    found = file_digest(path)
    if found != cfg.tokenizer_digest:
        raise DataError(f"the tokenizer '{path}' (digest {found[:16]}...) is not the one the "
                        f"manifest pins (data.tokenizer_digest = {cfg.tokenizer_digest[:16]}...): "
                        f"prepare the data again with the swarm's tokenizer.json "
                        f"(prepare-data --tokenizer)")


def check_shards_pin(cfg: DataConfig, root: Path, found: str) -> None:
    """The manifest's data.shards_digest against the shards in data.path."""
    if cfg.shards_digest and found != cfg.shards_digest:
        raise DataError(f"the token shards in '{root}' (digest {found[:16]}...) are not the ones "
                        f"the manifest pins (data.shards_digest = {cfg.shards_digest[:16]}...): "
                        f"prepare them with the swarm's recipe and tokenizer, or copy the "
                        f"swarm's shards")


def load_token_dir(root: Path, cfg: DataConfig) -> Corpus:
    """data.source = "tokens": a prepare-data directory, or nanoGPT's train.bin and val.bin.
    The manifest's pins are checked first, so that a node with another tokenizer or other
    shards hears which of the two differs (rather than a vocabulary or dtype that follows)."""
    check_tokenizer_pin(cfg, root)
    index = read_index(root)
    if index is not None:
        if not index.get("complete"):
            raise DataError(f"the preparation in '{root}' is not finished: run lowcomm-node "
                            f"prepare-data again with the same arguments to complete it")
        check_shards_pin(cfg, root, recorded_digest(index))
        return load_prepared(root, cfg, index)
    corpus = load_token_files(root, cfg.token_dtype, cfg.vocab_size)
    check_shards_pin(cfg, root, shards_digest(cfg.token_dtype, {
        s: [file_digest(root / f"{s}.bin")] for s in SPLITS}))
    return corpus


def pinned_data_settings(root: Path) -> dict[str, Any]:
    """The manifest's [data] values for a finished prepare-data directory (init-swarm --data)."""
    index = read_index(root)
    if index is None or not index.get("complete"):
        raise DataError(f"'{root}' is not a finished prepare-data directory: run lowcomm-node "
                        f"prepare-data --out {root} first")
    return {"source": "tokens", "path": str(root), "token_dtype": index["dtype"],
            "vocab_size": index["tokenizer"]["vocab_size"],
            "tokenizer_digest": index["tokenizer"]["digest"],
            "shards_digest": index["shards_digest"]}
