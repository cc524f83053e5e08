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
from node.rounds.state import STATE_KIND, StateLayout
from p2p.errors import P2PError, RemoteRefused

log = logging.getLogger("lowcomm.join")


class StateFetchFailed(Exception):
    """No holder completed the state; `errors`: (holder, the exception) of every failure."""

    def __init__(self, sentence: str, errors: list[tuple[str, Exception]]):
        super().__init__(sentence)
        self.errors = errors


@dataclass
class FetchedState:
    """A complete state's bytes as received, not yet checked against any digest."""

    groups: dict[str, dict[str, torch.Tensor]]  # fp32 views of `buffer`
    digest: str                                 # of φ as received
    meta: dict[str, Any]                        # the first reply's: round, phi_round, phi, total
    ranges: list[tuple[str, int, int]] = field(default_factory=list)  # (holder, start, end)
    bytes_fetched: int = 0    # payload of every range asked, one that failed (not refused) counted
                              # whole: an upper bound

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
                      usable: Callable[[str], bool] = lambda _peer: True) -> FetchedState:
    """The state after `phi_round` (None: the first holder's latest) whose φ has `digest` (None:
    whichever the first reply names), from `holders` in order; `usable(peer)` is asked before
    each range (a holder banned meanwhile is skipped). See the module's docstring."""
    total, chunk = layout.total, layout.chunk_bytes()
    buffer = torch.empty(total, dtype=torch.uint8)
    fetched: FetchedState | None = None
    errors: list[tuple[str, Exception]] = []
    offset = asked = 0
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
                try:
                    received = await transport.request(holder, STATE_KIND, 0, meta=meta,
                                                       expected_reply_bytes=length,
                                                       streams=transport.limits.parallel_streams)
                    _check_range(received, offset, length, total, phi_round, digest)
                except (P2PError, ValueError) as exc:
                    if isinstance(exc, RemoteRefused):  # refused before any byte of it was sent
                        asked -= length
                    log.warning("state range %d+%d from %s failed (%s); %d of %d bytes held",
                                offset, length, holder, exc, offset, total)
                    errors.append((holder, exc))
                    break
                meta_in = dict(received.meta)
                if fetched is None:
                    phi_round, digest = meta_in["phi_round"], meta_in["phi"]
                    fetched = FetchedState({}, "", meta_in)
                buffer.numpy()[offset:offset + length] = np.frombuffer(received.payload, dtype=np.uint8)
                del received
                fetched.ranges.append((holder, offset, offset + length))
                offset += length
                progressed = True
        if not progressed:
            break
    if offset < total or fetched is None:
        shown = "; ".join(f"{peer}: {exc}" for peer, exc in errors[-3:]) or "no holder was usable"
        raise StateFetchFailed(f"the state stopped at {offset} of {total} bytes ({shown})", errors)
    fetched.bytes_fetched = asked
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
