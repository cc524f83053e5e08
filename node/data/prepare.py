"""`lowcomm-node prepare-data`: documents in, a tokenizer and token shards out (layout in
node/data/shards.py).

The phases, each reported to a progress sink:
1. check: read every document once (node/data/sources.py): a bad file is refused before any
   work, each split must be non-empty, and the content is digested;
2. tokenizer: train a byte-level BPE on the training split, or copy the given tokenizer.json;
3. tokenize: documents in order, each followed by the end-of-text id (a long file's pieces
   only after the last), into shards of about `shard_tokens` tokens that end at a document
   (or piece) boundary.

Resumable: the index (dataset.json) is rewritten after every shard, naming for each split how
many of its documents the written shards hold. A run on the same inputs and settings checks the
shards it finds against their digests, keeps the good ones and goes on after them. Shard
boundaries depend only on the documents, so an interrupted and resumed preparation writes the
same bytes, and the same digests, as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from node.data.corpus import DataError
from node.data.shards import (INDEX_FORMAT, SPLITS, TOKENIZER_FILE, read_index, recorded_digest,
                              shard_name, write_atomically, write_index)
from node.data.sources import (Document, SourceSpec, check_sources, iter_documents, split_of,
                               total_bytes)
from node.data.tokenizer import (UINT16_VOCAB, end_of_text_id, file_digest, load_tokenizer,
                                 shard_dtype, train_bpe)

ENCODE_BATCH_BYTES = 4 << 20  # documents handed to the tokenizer's parallel encoder at once


class ProgressSink(Protocol):
    def start(self, phase: str, total: int) -> None: ...
    def advance(self, amount: int) -> None: ...


class NoProgress:
    def start(self, phase: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass


@dataclass
class PrepareSettings:
    out: Path
    sources: SourceSpec = field(default_factory=SourceSpec)
    tokenizer: Path | None = None   # a given tokenizer.json; else a BPE is trained
    vocab_size: int = 0             # the trained BPE's vocabulary
    dtype: str = "auto"             # shard dtype: auto (by vocabulary), uint16 or uint32
    val_fraction: float = 0.02
    shard_tokens: int = 1 << 24     # a shard closes at the first document end past this


def check_settings(s: PrepareSettings) -> None:
    """Refuses contradictory settings in one sentence, before anything is read."""
    if (s.tokenizer is None) == (s.vocab_size == 0):
        raise DataError("give exactly one of --tokenizer PATH (an existing tokenizer.json) or "
                        "--vocab-size N (train a byte-level BPE on the inputs)")
    if s.vocab_size and s.dtype == "uint16" and s.vocab_size > UINT16_VOCAB:
        raise DataError(f"--vocab-size {s.vocab_size:,} is too large for uint16 shards (at most "
                        f"{UINT16_VOCAB:,} ids): lower --vocab-size or use --dtype uint32")
    if not 0 < s.val_fraction <= 0.5:
        raise DataError(f"--val-fraction {s.val_fraction} is out of range: give a share above "
                        f"0 and at most 0.5")
    if s.shard_tokens < 1:
        raise DataError(f"--shard-tokens {s.shard_tokens} is out of range: it must be >= 1")


def _recipe(s: PrepareSettings, sources_digest: str, given_digest: str | None) -> dict[str, Any]:
    """What defines the output; a resumed run must ask for exactly this."""
    return {"sources_digest": sources_digest, "json_field": s.sources.json_field,
            "stdlib": s.sources.stdlib,
            "tokenizer": f"given {given_digest}" if given_digest else f"bpe {s.vocab_size}",
            "dtype": s.dtype, "val_fraction": s.val_fraction, "shard_tokens": s.shard_tokens}


def _check_same_recipe(out: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    for key in sorted(new):
        if old.get(key) != new[key]:
            raise DataError(f"'{out}' holds a preparation with another {key} ({old.get(key)!r} "
                            f"there, {new[key]!r} now): use another --out, or delete '{out}' "
                            f"to start over")


def _prepare_tokenizer(s: PrepareSettings, index: dict | None, progress: ProgressSink):
    """tokenizer.json in the output directory: copied, reused from an interrupted run, or
    trained on the training split."""
    target = s.out / TOKENIZER_FILE
    if s.tokenizer is not None:
        tokenizer = load_tokenizer(s.tokenizer)
        if s.tokenizer.resolve() != target.resolve():
            write_atomically(target, s.tokenizer.read_bytes())
        return tokenizer
    if index and target.is_file() and file_digest(target) == index["tokenizer"]["digest"]:
        return load_tokenizer(target)
    progress.start("training tokenizer", total_bytes(s.sources))

    def training_texts():
        for doc in iter_documents(s.sources):
            progress.advance(doc.size)
            if split_of(doc, s.val_fraction) == "train":  # validation stays unseen
                yield doc.text

    tokenizer = train_bpe(training_texts(), s.vocab_size)
    write_atomically(target, tokenizer.to_str().encode())
    return tokenizer


def _good_shards(out: Path, split_state: dict) -> dict:
    """The recorded shards of a split up to the first missing or altered one."""
    kept, done = [], 0
    for entry in split_state["shards"]:
        path = out / entry["file"]
        if not path.is_file() or file_digest(path) != entry["digest"]:
            break
        kept.append(entry)
        done = entry["documents_end"]
    return {"shards": kept, "documents_done": done}


class ShardWriter:
    """Collects one split's tokens and writes a shard at the first document end past the size."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int, state: dict,
                 on_shard: Callable[[], None]):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.state, self.on_shard = state, on_shard
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.documents = state["documents_done"]  # of this split, in reading order

    def add(self, ids: list[int]) -> None:
        self.pending.append(np.asarray(ids, dtype=self.dtype))
        self.pending_tokens += len(ids)
        self.documents += 1
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data = np.concatenate(self.pending).tobytes()
        name = shard_name(self.split, len(self.state["shards"]))
        write_atomically(self.out / name, data)
        self.state["shards"].append({
            "file": name, "tokens": self.pending_tokens, "documents_end": self.documents,
            "digest": hashlib.blake2b(data, digest_size=32).hexdigest()})
        self.state["documents_done"] = self.documents
        self.pending, self.pending_tokens = [], 0
        self.on_shard()


def _remove_strays(out: Path, index: dict) -> None:
    """Shards not in the index (written after the last index update) and temporaries."""
    recorded = {e["file"] for s in SPLITS for e in index["splits"][s]["shards"]}
    for path in out.iterdir():
        stray_shard = path.suffix == ".bin" and path.name.startswith(SPLITS) and \
            path.name not in recorded
        if stray_shard or ".tmp-" in path.name:
            path.unlink()


def _tokenize(s: PrepareSettings, index: dict, tokenizer, progress: ProgressSink) -> None:
    eos = index["tokenizer"]["end_of_text_id"]
    save = lambda: write_index(s.out, index)  # noqa: E731 - after every shard: resumable
    writers = {split: ShardWriter(s.out, split, index["dtype"], s.shard_tokens,
                                  index["splits"][split], save) for split in SPLITS}
    seen = {split: 0 for split in SPLITS}
    batch: list[tuple[str, Document]] = []
    batch_bytes = 0

    def encode_batch() -> None:
        texts = [doc.text for _, doc in batch]
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        for (split, doc), encoding in zip(batch, encodings):
            end = [eos] if eos is not None and doc.last else []
            writers[split].add(encoding.ids + end)
        batch.clear()

    progress.start("tokenizing", total_bytes(s.sources))
    for doc in iter_documents(s.sources):
        progress.advance(doc.size)
        split = split_of(doc, s.val_fraction)
        seen[split] += 1
        if seen[split] <= index["splits"][split]["documents_done"]:
            continue  # in a shard an interrupted run wrote
        batch.append((split, doc))
        batch_bytes += doc.size
        if batch_bytes >= ENCODE_BATCH_BYTES:
            encode_batch()
            batch_bytes = 0
    if batch:
        encode_batch()
    for writer in writers.values():
        writer.flush()


def prepare(s: PrepareSettings, progress: ProgressSink | None = None) -> dict[str, Any]:
    """Runs (or resumes, or confirms) a preparation; returns the finished index."""
    progress = progress or NoProgress()
    check_settings(s)
    given_digest = None
    if s.tokenizer is not None:  # a bad file or dtype is refused before the inputs are read
        given = load_tokenizer(s.tokenizer)
        shard_dtype(given.get_vocab_size(with_added_tokens=True), s.dtype)
        given_digest = file_digest(s.tokenizer)
    if s.out.exists() and not s.out.is_dir():
        raise DataError(f"--out '{s.out}' is a file: give a directory")
    s.out.mkdir(parents=True, exist_ok=True)
    old = read_index(s.out)
    if old is None and any(s.out.glob("*.bin")):
        raise DataError(f"--out '{s.out}' already holds token files not written by prepare-data: "
                        f"choose an empty or new directory")
    progress.start("checking inputs", total_bytes(s.sources))
    summary = check_sources(s.sources, s.val_fraction, progress.advance)
    recipe = _recipe(s, summary.digest, given_digest)
    if old is not None:
        _check_same_recipe(s.out, old["recipe"], recipe)
    tokenizer = _prepare_tokenizer(s, old, progress)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = shard_dtype(vocab, s.dtype)
    tokenizer_digest = file_digest(s.out / TOKENIZER_FILE)
    resumable = old is not None and old["tokenizer"]["digest"] == tokenizer_digest
    index = {"format": INDEX_FORMAT, "recipe": recipe, "dtype": dtype, "complete": False,
             "sources": {"files": summary.files, "documents": summary.documents,
                         "bytes": summary.bytes, "skipped_not_utf8": summary.skipped},
             "tokenizer": {"file": TOKENIZER_FILE, "digest": tokenizer_digest,
                           "vocab_size": vocab, "end_of_text_id": end_of_text_id(tokenizer)},
             "splits": {split: _good_shards(s.out, old["splits"][split]) if resumable
                        else {"shards": [], "documents_done": 0} for split in SPLITS}}
    if resumable and old.get("complete") and index["splits"] == old["splits"]:
        return old  # already finished, every shard checked against its digest
    _remove_strays(s.out, index)
    write_index(s.out, index)
    _tokenize(s, index, tokenizer, progress)
    index["complete"] = True
    index["shards_digest"] = recorded_digest(index)
    write_index(s.out, index)
    return index

