"""The documents `prepare-data` reads: text files, directories of them, JSON lines, or the
embedded corpus (this interpreter's standard library), in one fixed order.

A document is one text file, or one JSON line's named field. Each has a key (its path relative
to the input, plus ":<line>" for a JSON line) that decides its split by hash (the same rule as
node/data/corpus.py): the split is fixed, and does not shift when documents are added elsewhere.
A text file longer than PIECE_CHARS is cut into pieces at line ends, keyed "<path>#<n>", each
split on its own, so that one large file still gives a validation split; only the file's last
piece is followed by the end-of-text token.

`check_sources` reads everything once before any work starts, so that a bad file is reported
(in one sentence naming it and the fix) before an hour of tokenization, and digests the content.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from node.data.corpus import DataError, is_validation, stdlib_dir, text_files


PIECE_CHARS = 1 << 16  # a longer text file is cut into pieces of about this many characters


@dataclass(frozen=True)
class SourceSpec:
    """What to read: files or directories, JSON lines or plain text, or the embedded corpus."""
    inputs: tuple[Path, ...] = ()
    json_field: str | None = None  # set: every input file is JSON lines, this field the text
    stdlib: bool = False           # the embedded corpus instead of inputs (non-UTF-8 files skipped)


@dataclass(frozen=True)
class Document:
    key: str
    text: str
    size: int          # bytes read for it (the progress bar's unit)
    last: bool = True  # ends its file or JSON line: the end-of-text token follows it


@dataclass
class SourceSummary:
    files: int
    documents: dict[str, int]  # per split
    bytes: int
    digest: str   # BLAKE2b-256 of every (key, text): what the shards were made from
    skipped: int  # embedded corpus only: files that are not UTF-8


def _input_files(spec: SourceSpec) -> list[tuple[Path, str]]:
    """(file, key prefix) in reading order; an input that holds nothing is refused."""
    if spec.stdlib:
        root = stdlib_dir()
        return [(p, p.relative_to(root).as_posix()) for p in text_files(root, (".py",))]
    if not spec.inputs:
        raise DataError("no input was given: name text files, directories or JSON lines files "
                        "with --input, or use --stdlib for the embedded corpus")
    found = []
    for given in spec.inputs:
        if given.is_dir():
            files = text_files(given, None)
            if not files:
                raise DataError(f"input directory '{given}' holds no files: point --input at a "
                                f"directory of text files (or at the files themselves)")
            found.extend((p, f"{given.name}/{p.relative_to(given).as_posix()}") for p in files)
        elif given.is_file():
            found.append((given, given.name))
        else:
            raise DataError(f"input '{given}' does not exist: check the path given to --input")
    return found


def _decode(raw: bytes, path: Path, where: str = "") -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"input file '{path}'{where} is not UTF-8 text (byte "
                        f"0x{raw[exc.start]:02x} at offset {exc.start}): convert it to UTF-8 "
                        f"(for example iconv -f latin1 -t utf-8) or remove it from the input"
                        ) from None


def _json_documents(path: Path, key: str, field: str) -> Iterator[Document]:
    """One document a line, read a line at a time: a JSON lines file may exceed memory."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, path, f" line {number}")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"'{path}' line {number} is not valid JSON ({exc.msg}): fix or "
                                f"remove that line") from None
            if not isinstance(record, dict) or field not in record:
                fields = ", ".join(sorted(record)) if isinstance(record, dict) else "none"
                raise DataError(f"'{path}' line {number} has no field '{field}' (its fields: "
                                f"{fields}): name the text's field with --json-field")
            value = record[field]
            if not isinstance(value, str):
                raise DataError(f"'{path}' line {number}: field '{field}' is "
                                f"{type(value).__name__}, not text: name a text field with "
                                f"--json-field")
            yield Document(f"{key}:{number}", value, len(raw))


def _pieces(key: str, text: str) -> Iterator[Document]:
    """The text cut at the first line end past every PIECE_CHARS characters."""
    if len(text) <= PIECE_CHARS:
        yield Document(key, text, len(text.encode()))
        return
    start, number = 0, 0
    while start < len(text):
        end = text.find("\n", start + PIECE_CHARS) + 1 or len(text)
        piece = text[start:end]
        yield Document(f"{key}#{number}", piece, len(piece.encode()), last=end == len(text))
        start, number = end, number + 1


def iter_documents(spec: SourceSpec, on_file: Callable[[int], None] | None = None
                   ) -> Iterator[Document]:
    """Every document in reading order. `on_file(bytes)` is told of each skipped file."""
    for path, key in _input_files(spec):
        if spec.json_field is not None:
            yield from _json_documents(path, key, spec.json_field)
            continue
        raw = path.read_bytes()
        if not spec.stdlib:
            yield from _pieces(key, _decode(raw, path))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # a few test fixtures of the stdlib are in other codecs
            if on_file:
                on_file(len(raw))
            continue
        yield from _pieces(key, text)


def total_bytes(spec: SourceSpec) -> int:
    return sum(path.stat().st_size for path, _ in _input_files(spec))


def split_of(doc: Document, val_fraction: float) -> str:
    return "val" if is_validation(doc.key, val_fraction) else "train"


def check_sources(spec: SourceSpec, val_fraction: float,
                  advance: Callable[[int], None] = lambda n: None) -> SourceSummary:
    """Reads every document once: refuses a bad one, or an empty split, in one sentence, and
    digests them all."""
    digest = hashlib.blake2b(digest_size=32)
    skipped = [0]

    def skip(size: int) -> None:
        skipped[0] += 1
        advance(size)

    documents, size = {"train": 0, "val": 0}, 0
    for doc in iter_documents(spec, on_file=skip):
        data = doc.text.encode()
        digest.update(doc.key.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
        documents[split_of(doc, val_fraction)] += 1
        size += doc.size
        advance(doc.size)
    if not any(documents.values()):
        raise DataError("the inputs hold no documents (every JSON line is blank): give --input "
                        "files with text in them")
    for split, count in documents.items():
        if count == 0:
            raise DataError(f"the {sum(documents.values())} input documents gave an empty "
                            f"{'validation' if split == 'val' else 'training'} split at "
                            f"--val-fraction {val_fraction}: add documents (files or JSON "
                            f"lines), or change --val-fraction")
    return SourceSummary(len(_input_files(spec)), documents, size, digest.hexdigest(), skipped[0])
