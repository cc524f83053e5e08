"""Checkpoints in the node's data directory: atomic, checksummed, the last two kept.

File layout: MAGIC (8 bytes) | BLAKE2b-256 of the payload (32 bytes) | payload (torch.save).
Invariants:
- A checkpoint file appears under its final name only when it is complete: it is written to a
  temporary file, fsynced, renamed, and the directory fsynced. A kill at any moment leaves the
  previous checkpoint loadable.
- A truncated or corrupt file is detected by the checksum before unpickling, reported in one
  sentence, and the previous checkpoint is used instead.
- Loading never executes code from the file (torch.load with weights_only=True).
- The checkpoint numbered highest is the last one saved: a save removes those numbered above it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"LCNCKPT1"
HEADER = len(MAGIC) + 32
NAME = re.compile(r"^ckpt-(\d{10})\.pt$")
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used; the message names the file and the reason."""


@dataclass
class LoadedCheckpoint:
    state: dict
    path: Path
    skipped: list[str]  # one sentence per newer checkpoint that was corrupt


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingFile:
    """What torch.save writes to: each piece goes to the file and into the checksum as it comes,
    so a checkpoint is never held whole in memory (encoding it into one buffer, then copying that
    buffer twice, took three times the state at its peak: benchmarks/node_memory.py)."""

    def __init__(self, file, hasher):
        self.file, self.hasher = file, hasher
        self.error: OSError | None = None  # torch.save reports a failed write as its own RuntimeError

    def write(self, data) -> int:
        self.hasher.update(data)
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def write_checkpoint(state: dict, file) -> None:
    """MAGIC | checksum | torch.save(state) into the open binary `file`, streamed."""
    hasher = hashlib.blake2b(digest_size=32)
    file.write(MAGIC + bytes(32))
    sink = _HashingFile(file, hasher)
    try:
        torch.save(state, sink)
    except Exception:
        if sink.error is not None:  # a full disk: the OSError, not torch's "unexpected pos"
            raise sink.error from None
        raise
    file.seek(len(MAGIC))
    file.write(hasher.digest())


def decode(blob: bytes, name: str) -> dict:
    if len(blob) < HEADER or blob[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"checkpoint {name} is not a lowcomm-node checkpoint or is "
                              f"truncated ({len(blob)} bytes)")
    payload = memoryview(blob)[HEADER:]
    if hashlib.blake2b(payload, digest_size=32).digest() != blob[len(MAGIC):HEADER]:
        raise CheckpointError(f"checkpoint {name} is corrupt (checksum mismatch)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # a valid checksum over bytes torch cannot read: a foreign file
        raise CheckpointError(f"checkpoint {name} has a valid checksum but cannot be read "
                              f"by this version of torch ({exc.__class__.__name__})") from None


class CheckpointStore:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory)
        self.keep = keep

    def paths(self) -> list[Path]:
        """Complete checkpoint files, newest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if NAME.match(p.name)]
        return sorted(found, key=lambda p: int(NAME.match(p.name).group(1)), reverse=True)

    def save(self, state: dict, step: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"ckpt-{step:010d}.pt"
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                write_checkpoint(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except OSError as exc:  # a full or read-only disk: one sentence, nothing half-written
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not write checkpoint {final.name} in {self.directory}: "
                                  f"{exc.strerror or exc}; the previous checkpoint is kept") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # Newest first by step: one numbered above this save predates it (a NoLoCo node that ran
        # ahead of its swarm went back to the swarm's round), and would be resumed from instead.
        for old in self.paths():
            if int(NAME.match(old.name).group(1)) > step:
                old.unlink(missing_ok=True)
        for old in self.paths()[self.keep:]:
            old.unlink(missing_ok=True)
        return final

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest readable checkpoint, or None when there is none at all.

        Corrupt newer files are skipped with one log line each; they are left on disk for
        inspection and overwritten by the next saves.
        """
        skipped = []
        for path in self.paths():
            try:
                state = decode(path.read_bytes(), path.name)
            except (CheckpointError, OSError) as exc:
                reason = f"{exc}; using the previous checkpoint instead"
                log.warning(reason)
                skipped.append(reason)
                continue
            return LoadedCheckpoint(state, path, skipped)
        if skipped:
            raise CheckpointError(f"no readable checkpoint is left in {self.directory} "
                                  f"({len(skipped)} corrupt): move the directory aside to start "
                                  f"fresh")
        return None

    def remove_stale_temporaries(self) -> None:
        """Leftovers of a write killed mid-way; never loaded, safe to delete at start-up."""
        if self.directory.is_dir():
            for p in self.directory.glob(".ckpt-*.tmp-*"):
                p.unlink(missing_ok=True)
