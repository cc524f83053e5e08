"""Downloading one member's state, range by range, resuming where a broken transfer stopped.

Rules (the server's side: node/daemon/state_serving.py):
- The bytes arrive in ranges of `StateLayout.chunk_bytes` into one buffer of the layout's size
  (a model-sized state is held once); each range is asked of one holder after the other. A
  range that fails (the holder left, stalled, refused) is asked again, from where it stopped,
  of the next holder in the list: what arrived is never fetched again. A transfer that breaks
  loses at most the range in flight.
- The first reply fixes the round and the digest of φ; every later range is asked for that
  round and digest, so ranges from different holders belong to one state (a holder that no
  longer holds it refuses). The digest of φ is checked once, over the whole buffer, by the
  caller (against the majority's or the server's announcement); a mismatch is blamed on the
  holder only when it served every byte of φ.
- No fixed time bounds the download: each range is one request, which the transport ends
  only when it stalls (`node.stall_s`) or cannot finish its bytes at the swarm's declared
  minimum link rate (`protocol.min_link_mbit_s`; p2p/progress.py). A download that keeps
  moving therefore takes as long as its bytes need; one that stalls ends within the stall
  bound, and the next holder is asked from where it stopped.
- A caller may resume a failed download (`StateFetchFailed.partial`) from holders of another
  state (NoLoCo members each hold their own): the buffer then holds the ranges of two states,
  and the caller checks each holder's ranges (`StateSketch.mismatches`).
- The holders are tried in turn while a pass over them brings bytes; a pass that brings none
  ends the download (every error kept, one sentence each).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from p2p.limits import TransferLimits
from node.rounds.state import FP32_BYTES, SKETCH_MAX_VALUES, STATE_KIND, StateLayout, sketch_indices
from p2p.errors import P2PError, RemoteRefused

log = logging.getLogger("lowcomm.join")


class StateFetchFailed(Exception):
    """No holder completed the state; `errors`: (holder, the exception) of every failure;
    `partial`: the bytes that did arrive (None if none), for `fetch_state(resume=...)`."""

    def __init__(self, sentence: str, errors: list[tuple[str, Exception]],
                 partial: FetchedState | None = None):
        super().__init__(sentence)
        self.errors, self.partial = errors, partial


@dataclass
class FetchedState:
    """A complete state's bytes as received, not yet checked against any digest."""

    groups: dict[str, dict[str, torch.Tensor]]  # fp32 views of `buffer`
    digest: str                                 # of φ as received
    meta: dict[str, Any]                        # the first reply's: round, phi_round, phi, total
    ranges: list[tuple[str, int, int]] = field(default_factory=list)  # (holder, start, end)
    bytes_fetched: int = 0    # payload of every range asked; one that failed counted as the bytes
                              # our transport read meanwhile (at most the range; whole where the
                              # transport counts none): an upper bound
    buffer: torch.Tensor | None = None  # uint8, the layout's total bytes; [0, held) arrived
    held: int = 0

    def flat(self) -> np.ndarray:
        """The bytes held so far as fp32 values (a view)."""
        return self.buffer.numpy()[:self.held].view(np.float32)

    def parts(self) -> dict[str, list[tuple[int, int]]]:
        """Each holder's byte ranges."""
        out: dict[str, list[tuple[int, int]]] = {}
        for source, start, end in self.ranges:
            out.setdefault(source, []).append((start, end))
        return out

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(source for source, _, _ in self.ranges))

    def served_phi_alone(self) -> str | None:
        """The holder that served every byte of φ (the first half of the layout), if one did."""
        half = sum(end - start for _, start, end in self.ranges) // 2
        phi = {source for source, start, _ in self.ranges if start < half}
        return phi.pop() if len(phi) == 1 else None


def download_bound_s(layout: StateLayout, limits: TransferLimits) -> float:
    """The longest a whole download from one holder may take: every range at the transport's
    bound for its bytes (p2p/limits.py TransferLimits.need_by_s)."""
    total, chunk = layout.total, layout.chunk_bytes()
    full, rest = divmod(total, chunk)
    return full * limits.need_by_s(chunk) + (limits.need_by_s(rest) if rest else 0.0)


async def fetch_state(transport, holders: list[str], layout: StateLayout, *,
                      phi_round: int | None = None, digest: str | None = None,
                      usable: Callable[[str], bool] = lambda _peer: True,
                      resume: FetchedState | None = None) -> FetchedState:
    """The state after `phi_round` (None: the first holder's latest) whose φ has `digest` (None:
    whichever the first reply names), from `holders` in order; `usable(peer)` is asked before
    each range (a holder banned meanwhile is skipped). `resume`: a failed download's `partial`,
    continued where it stopped into the same buffer (from `holders`, of their `phi_round` and
    `digest`, which may be another state's: the caller checks what it assembles). See the
    module's docstring."""
    total, chunk = layout.total, layout.chunk_bytes()
    fetched: FetchedState | None = resume
    buffer = resume.buffer if resume is not None else torch.empty(total, dtype=torch.uint8)
    errors: list[tuple[str, Exception]] = []
    offset, asked = (resume.held, resume.bytes_fetched) if resume is not None else (0, 0)
    while offset < total:
        progressed = False
        for holder in holders:
            while offset < total and usable(holder):
                length = min(chunk, total - offset)
                meta = {"offset": offset, "length": length}
                if phi_round is not None:
                    meta["phi_round"] = phi_round
                if digest is not None:
                    meta["phi"] = digest
                asked += length
                counters = getattr(transport, "counters", None)
                read_before = counters.bytes_received if counters is not None else None
                try:
                    received = await transport.request(holder, STATE_KIND, 0, meta=meta,
                                                       expected_reply_bytes=length,
                                                       streams=transport.limits.parallel_streams)
                    _check_range(received, offset, length, total, phi_round, digest)
                except (P2PError, ValueError) as exc:
                    if isinstance(exc, RemoteRefused):  # refused before any byte of it was sent
                        asked -= length
                    elif read_before is not None:  # what arrived of it, at most (other streams too)
                        asked -= length - min(length, counters.bytes_received - read_before)
                    log.warning("state range %d+%d from %s failed (%s); %d of %d bytes held",
                                offset, length, holder, exc, offset, total)
                    errors.append((holder, exc))
                    break
                meta_in = dict(received.meta)
                if phi_round is None or digest is None:
                    phi_round, digest = meta_in["phi_round"], meta_in["phi"]
                if fetched is None:
                    fetched = FetchedState({}, "", meta_in, buffer=buffer)
                buffer.numpy()[offset:offset + length] = np.frombuffer(received.payload, dtype=np.uint8)
                del received
                fetched.ranges.append((holder, offset, offset + length))
                offset = fetched.held = offset + length
                progressed = True
        if not progressed:
            break
    if fetched is not None:
        fetched.bytes_fetched = asked
    if offset < total or fetched is None:
        shown = "; ".join(f"{peer}: {exc}" for peer, exc in errors[-3:]) or "no holder was usable"
        raise StateFetchFailed(f"the state stopped at {offset} of {total} bytes ({shown})", errors,
                               fetched)
    fetched.groups, fetched.digest = await asyncio.get_running_loop().run_in_executor(
        None, layout.decode, buffer)
    log.info("state download: %d bytes fetched for a state of %d bytes, from %d holder(s) (%s)",
             asked, total, len(fetched.sources), ", ".join(s[-8:] for s in fetched.sources))
    return fetched


def _check_range(received, offset: int, length: int, total: int, phi_round: int | None,
                 digest: str | None) -> None:
    """The reply is the range asked, of the state pinned so far; ValueError otherwise."""
    meta = received.meta
    if meta.get("total") != total:
        raise ValueError(f"it serves a state of {meta.get('total')!r} bytes; this model's is {total}")
    if meta.get("offset") != offset or len(received.payload) != length:
        raise ValueError(f"it served {len(received.payload)} bytes at {meta.get('offset')!r}, "
                         f"not {length} at {offset}")
    if type(meta.get("phi_round")) is not int or not isinstance(meta.get("phi"), str):
        raise ValueError("its reply names no round or digest")
    if phi_round is not None and digest is not None \
            and (meta["phi_round"], meta["phi"]) != (phi_round, digest):
        raise ValueError(f"it serves round {meta['phi_round']} ({meta['phi'][:12]}), not the "
                         f"state being fetched")


@dataclass
class StateSketch:
    """A member's state seen through `sketch_indices(seed, ...)`: its values there, and the
    round and digest of φ its server named (node/daemon/state_serving.py serves it)."""

    source: str
    meta: dict[str, Any]
    indices: np.ndarray  # element indices into the state's fp32 values, sorted
    values: np.ndarray   # fp32, the state's values at `indices`
    phi_elements: int    # φ is the state's first half: elements below this

    @property
    def digest(self) -> str:
        return self.meta["phi"]

    def _phi(self) -> tuple[np.ndarray, float]:
        """φ's sampled values (float64) and the factor that scales their squares to φ's."""
        count = int(np.searchsorted(self.indices, self.phi_elements))
        return self.values[:count].astype(np.float64), self.phi_elements / max(1, count)

    def phi_norm(self) -> float:
        values, factor = self._phi()
        return float(np.sqrt(factor * np.square(values).sum()))

    def phi_distance(self, other: StateSketch) -> float:
        """The estimated distance between the two φ (sketches of one seed)."""
        (mine, factor), (theirs, _) = self._phi(), other._phi()
        return float(np.sqrt(factor * np.square(mine - theirs).sum()))

    def group_norms(self) -> tuple[float, float]:
        """The estimated norms of φ and of the momentum."""
        count = int(np.searchsorted(self.indices, self.phi_elements))
        rest = self.values[count:].astype(np.float64)
        return self.phi_norm(), float(np.sqrt(self.phi_elements / max(1, len(rest)) * np.square(rest).sum()))

    def mismatches(self, fetched: FetchedState, start: int, end: int) -> int:
        """How many sampled values within bytes [start, end) of `fetched` differ (bit for bit)."""
        low, high = np.searchsorted(self.indices, (start // FP32_BYTES, end // FP32_BYTES))
        got = fetched.buffer.numpy().view(np.uint32)[self.indices[low:high]]
        return int((got != self.values[low:high].view(np.uint32)).sum())


async def fetch_sketch(transport, holder: str, layout: StateLayout, seed: int, *,
                       count: int = SKETCH_MAX_VALUES, phi_round: int | None = None,
                       digest: str | None = None) -> StateSketch:
    """`holder`'s sketch of its latest state (or of `phi_round` and `digest`); P2PError or
    ValueError (one sentence) if it does not answer or answers something else."""
    meta: dict[str, Any] = {"sketch": seed, "count": count}
    if phi_round is not None and digest is not None:
        meta |= {"phi_round": phi_round, "phi": digest}
    elements = layout.total // FP32_BYTES
    indices = sketch_indices(seed, elements, count)
    received = await transport.request(holder, STATE_KIND, 0, meta=meta,
                                       expected_reply_bytes=FP32_BYTES * len(indices))
    reply = dict(received.meta)
    if reply.get("total") != layout.total or reply.get("sketch") != seed:
        raise ValueError(f"it answered a sketch of {reply.get('total')!r} bytes for seed "
                         f"{reply.get('sketch')!r}, not of {layout.total} for {seed}")
    if type(reply.get("phi_round")) is not int or not isinstance(reply.get("phi"), str):
        raise ValueError("its sketch names no round or digest")
    if len(received.payload) != FP32_BYTES * len(indices):
        raise ValueError(f"its sketch holds {len(received.payload)} bytes, not {FP32_BYTES * len(indices)}")
    values = np.frombuffer(bytes(received.payload), dtype=np.float32).copy()
    return StateSketch(holder, reply, indices, values, elements // 2)
