"""The outer state a member serves (what a late joiner downloads, and a diverged DiLoCoX node
too), and the digest of φ it announces in its member record to verify that state against.

The state travels in byte ranges (node/daemon/state_serving.py serves them,
node/rounds/state_fetch.py downloads them): a member exports a round's state once
(`StateExport`, read-only, shared by every request for that round) and answers a request for a
range (meta "offset", "length"; "phi_round" for the state after a given round, DiLoCoX members
keep the last two; "phi" for the state with that digest only) with fp32 tensors viewing the
export's bytes (`StateExport.chunk`: views, never copies), and in its signed header the round
the state belongs to ("phi_round"), the digest of φ ("phi"), the server's current round
("round"), the range's offset and the state's total bytes. The layout both sides know without
sending it (`StateLayout`): for each group of `GROUPS`, each tensor of the model by sorted name,
in fp32, concatenated. A downloader fills one buffer of `StateLayout.total` bytes and checks the
digest of φ once, at the end.

Exporting, decoding and hashing touch whole models: callers run them off the event loop
(`loop.run_in_executor`). `encode_state` / `decode_state` are the whole state as one message's
named tensors (the benchmarks of a state's memory use them).

The announcement (`announcement`, kept current by node/daemon/members.py PhiAnnouncer) holds the
digest of φ after the member's latest round and the one before it: a member a round ahead still
shows the digest of the round another node compares or downloaded (`announced_phi`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from node.rounds.wire_tensors import from_wire, to_wire
from p2p.messages import OutgoingTensor
from p2p.records import MemberRecord
from protocol.tensors import weights_digest

STATE_KIND = "state"
GROUPS = ("phi", "momentum")
FP32_BYTES = 4
# A download asks for ranges of at most `CHUNK_MAX_BYTES`, and at most a `CHUNK_FRACTION` of the
# state (at least `CHUNK_MIN_BYTES`): a broken transfer loses at most one range's bytes.
CHUNK_MAX_BYTES = 32 * 1024 * 1024
CHUNK_MIN_BYTES = 256 * 1024
CHUNK_FRACTION = 1 / 20
DIGESTS_KEPT = 256
# A sketch (`StateExport.sample`) holds at most this many of a state's fp32 values: 256 KiB
SKETCH_MAX_VALUES = 1 << 16


@dataclass(frozen=True)
class StateLayout:
    """Where each tensor of a state lies in its bytes (see the module's docstring): derived from
    the model's tensor names and shapes alone, so a downloader knows every byte count before
    asking (its own φ is the reference)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape), sorted by name

    @classmethod
    def of(cls, reference: Mapping[str, torch.Tensor]) -> StateLayout:
        return cls(tuple((name, tuple(reference[name].shape)) for name in sorted(reference)))

    @property
    def total(self) -> int:
        return len(GROUPS) * FP32_BYTES * sum(math.prod(shape) for _, shape in self.shapes)

    def chunk_bytes(self) -> int:
        """The length of the ranges a download asks for."""
        size = max(CHUNK_MIN_BYTES, min(CHUNK_MAX_BYTES, math.ceil(self.total * CHUNK_FRACTION)))
        return size - size % FP32_BYTES  # ranges hold whole fp32 elements

    def decode(self, buffer: torch.Tensor) -> tuple[dict[str, dict[str, torch.Tensor]], str]:
        """({"phi": φ, "momentum": ...}, the digest of φ) from a uint8 buffer of `total` bytes:
        fp32 views of the buffer, not copies (callers only read them; adopting copies)."""
        if buffer.dtype != torch.uint8 or buffer.numel() != self.total:
            raise ValueError(f"a state of this model is {self.total} bytes, not {buffer.numel()}")
        groups: dict[str, dict[str, torch.Tensor]] = {}
        offset = 0
        for group in GROUPS:
            groups[group] = {}
            for name, shape in self.shapes:
                size = FP32_BYTES * math.prod(shape)
                groups[group][name] = buffer[offset:offset + size].view(torch.float32).view(shape)
                offset += size
        return groups, weights_digest(groups["phi"])


@dataclass(frozen=True, eq=False)
class StateExport:
    """One round's state as served: made once (`of`), read-only, shared by every request for
    that round; its bytes are the layout's (see the module's docstring). A request's reply
    views a range of them (`chunk`): nothing is copied per request. Holding it keeps the
    export alive; the server keeps the latest and lets older ones go with their last reply."""

    round: int
    digest: str
    tensors: tuple[OutgoingTensor, ...]
    total: int
    # frame digests of each range's replies, shared by their messages (p2p/messages.py): a range
    # asked by several joiners is hashed once; at most DIGESTS_KEPT ranges are remembered
    frame_digests: dict[tuple[int, int], dict] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, round_index: int, groups: dict[str, dict[str, torch.Tensor]], digest: str) -> StateExport:
        """The export of `groups` (φ and momentum, as a round's export_state gives them: tensors
        no one writes to again). fp32 tensors on the host are viewed, not copied."""
        tensors = tuple(t for group in GROUPS for t in to_wire(
            {name: groups[group][name] for name in sorted(groups[group])}, "fp32", f"{group}/"))
        for t in tensors:
            t.data.flags.writeable = False  # the export is shared: nobody may write into it
        return cls(round_index, digest, tensors, sum(t.data.nbytes for t in tensors))

    def digests_of(self, offset: int, length: int) -> dict:
        """The frame-digest cache of the range's replies (a fresh one past DIGESTS_KEPT ranges:
        a peer asking odd ranges cannot grow it)."""
        if (offset, length) not in self.frame_digests and len(self.frame_digests) >= DIGESTS_KEPT:
            return {}
        return self.frame_digests.setdefault((offset, length), {})

    def sample(self, indices: np.ndarray) -> np.ndarray:
        """The state's fp32 values at element `indices` (sorted, within the state): a sketch."""
        out, position = np.empty(len(indices), dtype=np.float32), 0
        for tensor in self.tensors:
            flat = tensor.data.reshape(-1).view(np.uint8).view(np.float32)
            low, high = np.searchsorted(indices, (position, position + flat.size))
            out[low:high] = flat[indices[low:high] - position]
            position += flat.size
        return out

    def chunk(self, offset: int, length: int) -> list[OutgoingTensor]:
        """Bytes [offset, offset + length) as fp32 views of the export's tensors, one per tensor
        it touches (each no larger than that tensor: the swarm's wire limits bound a tensor's
        elements by the model's largest); `offset` and `length` are multiples of 4."""
        if not (0 <= offset < self.total and 0 < length) or offset % FP32_BYTES or length % FP32_BYTES:
            raise ValueError(f"bytes {offset}+{length} are not whole fp32 elements of a state of "
                             f"{self.total} bytes")
        out, position, stop = [], 0, min(self.total, offset + length)
        for tensor in self.tensors:
            flat = tensor.data.reshape(-1).view(np.uint8)
            start, end = max(offset, position), min(stop, position + flat.nbytes)
            if start < end:
                out.append(OutgoingTensor(f"part/{len(out)}", "float32", ((end - start) // FP32_BYTES,),
                                          flat[start - position:end - position].view(np.float32)))
            position += flat.nbytes
            if position >= stop:
                break
        return out


def sketch_indices(seed: int, elements: int, count: int) -> np.ndarray:
    """The sorted element indices a sketch of `seed` samples from a state of `elements` fp32
    values: every element when `count` covers them all, else `count` drawn at random (with
    replacement) by numpy's PCG64 from `seed`, the same on both sides of a request."""
    if count >= elements:
        return np.arange(elements, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).integers(0, elements, count, dtype=np.int64))


def encode_state(groups: dict[str, dict[str, torch.Tensor]]) -> list:
    return [t for group in GROUPS for t in to_wire(groups[group], "fp32", f"{group}/")]


def announcement(digest: str, round_index: int, previous: dict[str, Any]) -> dict[str, Any]:
    """The member record fields announcing φ's `digest` after `round_index`; `previous` is the
    record's fields before (its latest announcement becomes the one before)."""
    return {"phi": digest, "phi_round": round_index, "phi_prev": previous.get("phi", ""),
            "phi_prev_round": previous.get("phi_round", -1)}


def announced_phi(extra: dict[str, Any], round_index: int) -> str | None:
    """A member's announced φ digest after `round_index`: its latest, or the one before."""
    for digest, announced in (("phi", "phi_round"), ("phi_prev", "phi_prev_round")):
        if extra.get(announced) == round_index and isinstance(extra.get(digest), str):
            return extra[digest]
    return None


def phi_holders(members: list, round_index: int) -> dict[str, list[str]]:
    """The members (MemberRecords) announcing a φ digest after `round_index`, by digest, in
    the members' order."""
    holders: dict[str, list[str]] = {}
    for r in members:
        if digest := announced_phi(r.extra, round_index):
            holders.setdefault(digest, []).append(r.peer_id)
    return holders


# How far an honest member's round can run ahead of the rounds known to have passed (the
# majority's, or as many as this node could have trained since it started): 4x, plus 16.
LEAD_FACTOR, LEAD_ROUNDS = 4, 16


def round_bound(rounds_passed: float) -> int:
    """The highest round an honest member can claim while `rounds_passed` rounds are known."""
    return int(LEAD_FACTOR * rounds_passed) + LEAD_ROUNDS


def majority(count: int) -> int:
    return count // 2 + 1


def settled(members: list[MemberRecord]) -> list[MemberRecord]:
    """Members past their own join: a node still joining (status "joining", round 0) holds no
    state and has no say, so that joiners arriving together do not outvote the running swarm."""
    return [r for r in members if r.status != "joining"]


def agreed_round(members: list[MemberRecord]) -> int:
    """The highest round a majority of the settled `members` reached (0 for none): a minority of
    liars keeps it within the honest members' rounds (the round a late joiner starts at, and the
    one a DiLoCoX node that fell behind catches up to)."""
    rounds = sorted((r.round for r in settled(members)), reverse=True)
    return rounds[majority(len(rounds)) - 1] if rounds else 0


def decode_state(received: Any) -> tuple[dict[str, dict[str, torch.Tensor]], str]:
    """({"phi": φ, "momentum": ...} in fp32, the digest of φ as received). The tensors are views
    of the received message's buffer, not copies (a model-sized state is held once): callers
    only read them, and adopting one copies out of them (protocol/noloco.py, protocol/diloco.py
    load_state_dict; InnerTrainer.load_parameters)."""
    groups = {group: from_wire(received, f"{group}/", share=True) for group in GROUPS}
    return groups, weights_digest(groups["phi"])
