"""Serving our outer state to late joiners and to diverged DiLoCoX members, for real model sizes.

Rules:
- One export per round: the first request for a round's state exports it (`StateExport`, one
  copy of φ and momentum at most, made off the event loop) and every request for that round,
  concurrent or later, replies from it; an export lives while the server keeps it (the latest
  one) or a reply still sends from it (older ones), never longer. Serving N joiners at once
  costs one state, not N.
- A request asks for a byte range of the state (meta "offset", "length", at most
  `CHUNK_MAX_BYTES`), of the round after `phi_round` if given (DiLoCoX keeps two), and, if it
  gives `phi`, only of the state with that digest: a download resumed from another holder
  never mixes two states. The reply's tensors view the export's bytes (no copy); its meta says
  the server's round, the state's round, its digest and the state's total bytes.
- A download in progress keeps its export: a peer that asked for a range of a state, and not
  yet its last, pins that export (a NoLoCo member moves on to its next round long before a
  large state crosses a home link; without the pin the rest of the download would be refused).
  At most `PINNED_OLDER` exports older than the latest are pinned (their downloaders' pins
  beyond that, the oldest rounds first, are dropped: such a download is refused and restarts
  on the latest state), so serving holds at most 1 + `PINNED_OLDER` exports, whatever the
  number of peers.
- A request with meta "sketch" (a seed) and "count" asks instead for the state's values at the
  elements `sketch_indices` draws from that seed (at most `SKETCH_MAX_VALUES`, 256 KiB): what a
  NoLoCo joiner compares members' states by before it downloads one of them whole.
- A request with meta "release" drops the peer's pin (a joiner's, once its join is over,
  whatever came of it): a member it only asked for a sketch keeps no older export for it.
- At most one state request of each peer is served at a time: a peer's request holds its slot
  from `respond` until the transport says that request's exchange is over (`finished`, given
  to `transport.on_request`). A second request while the first's exchange is still on waits up
  to `BUSY_WAIT_S` for the slot (the peer's next range often comes while the last status of the
  previous one is still exchanged), then is refused BUSY with the reason. A downloader asks for
  one range after the other, so an honest one is not refused; a peer cannot make us send it
  several replies at once.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

from node.rounds.policy import RoundPolicy
from node.rounds.state import (CHUNK_MAX_BYTES, FP32_BYTES, SKETCH_MAX_VALUES, STATE_KIND, StateExport,
                               sketch_indices)
from p2p.errors import Reason, Refusal
from p2p.messages import OutgoingMessage, OutgoingTensor


PINNED_OLDER = 2
# A peer's next range may come while the last status of our reply to its previous one is still
# being exchanged: it waits this long for that reply to be let go before it is refused BUSY.
BUSY_WAIT_S = 5.0


class StateServer:
    """The reply handler of STATE_KIND requests for one round policy (`register` puts it on a
    transport with the `finished` its per-peer slots depend on)."""

    def __init__(self, policy: RoundPolicy, current_round: Callable[[], int | None] | None = None,
                 busy_wait_s: float | None = None):
        """`policy`: its export_state and state_version are called in a worker thread;
        `current_round()`: the round we train now, for the reply's meta (None: the state's
        round + 1)."""
        self.policy, self.current_round = policy, current_round
        self.busy_wait_s = BUSY_WAIT_S if busy_wait_s is None else busy_wait_s
        self.latest: StateExport | None = None
        self._by_version: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._exporting = asyncio.Lock()
        self._taken: set[bytes] = set()  # peers whose request's exchange is not over yet
        self._let_go: dict[bytes, asyncio.Event] = {}  # set when the peer's slot is freed
        self._pinned: dict[bytes, StateExport] = {}  # peer -> the export it is downloading
        self.exports_made = 0

    def register(self, transport, respond: Callable | None = None) -> None:
        """Answers STATE_KIND requests on `transport` with `respond` (default `self.respond`; a
        wrapper of it, e.g. one that counts refusals), each peer's slot freed by the transport's
        `finished` once its request's exchange is over."""
        transport.on_request(STATE_KIND, respond or self.respond, accept_round=lambda _r: True,
                             finished=self.finished)

    def in_flight(self, peer: bytes) -> bool:
        return peer in self._taken

    async def _slot(self, peer: bytes) -> bool:
        """Waits (at most busy_wait_s) until `peer` has no request in flight; True if free."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.busy_wait_s
        while peer in self._taken:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._let_go.setdefault(peer, asyncio.Event()).wait(), remaining)
            except TimeoutError:
                return False
        return True

    def finished(self, header) -> None:
        """The transport's word that the exchange of `header`'s request is over: its slot is free."""
        self._release(header.sender)

    def _release(self, peer: bytes) -> None:
        self._taken.discard(peer)
        if (event := self._let_go.pop(peer, None)) is not None:
            event.set()

    async def export(self, round_index: int | None, digest: str | None = None) -> StateExport:
        """The shared export of the state after `round_index` (None: the latest); one with
        `digest` if a download of it is still in progress or replying."""
        held = self._by_version.get((round_index, digest))
        if held is not None:
            return held
        loop = asyncio.get_running_loop()
        async with self._exporting:  # concurrent first requests make one export, not several
            version = await loop.run_in_executor(None, self.policy.state_version, round_index)
            held = self._by_version.get(version)
            if held is not None:
                return held
            state_round, groups, digest = await loop.run_in_executor(
                None, self.policy.export_state, round_index)
            if state_round < 0:
                raise Refusal(Reason.REFUSED, "no completed round yet")
            made = await loop.run_in_executor(None, StateExport.of, state_round, groups, digest)
            del groups  # the export views or holds what it needs
            self.exports_made += 1
            self._by_version[(made.round, made.digest)] = made
            if self.latest is None or made.round >= self.latest.round:
                self.latest = made
            return made

    async def respond(self, header) -> OutgoingMessage:
        peer = header.sender
        if not await self._slot(peer):
            raise Refusal(Reason.BUSY, "this node is still sending you a state range; ask for the "
                                       "next one when it has arrived")
        self._taken.add(peer)  # until `finished`, or until this raises
        try:
            return await self._reply(peer, header.meta)
        except BaseException:
            self._release(peer)
            raise

    async def _reply(self, peer: bytes, meta) -> OutgoingMessage:
        if meta.get("release") is True:  # the peer's join is over: its pin goes
            self._pinned.pop(peer, None)
            return OutgoingMessage(STATE_KIND, 0, (), {"released": True})
        wanted, digest = meta.get("phi_round"), meta.get("phi")
        offset, length = meta.get("offset", 0), meta.get("length", CHUNK_MAX_BYTES)
        if type(offset) is not int or type(length) is not int or length <= 0 \
                or offset % FP32_BYTES or length % FP32_BYTES:
            raise Refusal(Reason.MALFORMED, "a state request's offset and length must be "
                                            "multiples of 4 (whole fp32 elements), the length positive")
        export = await self.export(wanted if type(wanted) is int else None,
                                   digest if isinstance(digest, str) else None)
        if isinstance(digest, str) and digest != export.digest:
            raise Refusal(Reason.REFUSED, f"this node holds a state of round {export.round} with "
                                          f"digest {export.digest[:12]}, not {digest[:12]}")
        if type(wanted) is int and wanted != export.round and isinstance(digest, str):
            raise Refusal(Reason.REFUSED, f"this node no longer holds the state of round {wanted}")
        round_now = self.current_round() if self.current_round else None
        round_now = export.round + 1 if round_now is None else round_now
        said = {"round": round_now, "phi_round": export.round, "phi": export.digest, "total": export.total}
        if "sketch" in meta:
            return self._sketch(peer, export, meta.get("sketch"), meta.get("count"), said)
        if not 0 <= offset < export.total:
            raise Refusal(Reason.MALFORMED, f"offset {offset} lies outside the state's "
                                            f"{export.total} bytes")
        length = min(length, CHUNK_MAX_BYTES, export.total - offset)
        self._pin(peer, export, done=offset + length >= export.total)
        return OutgoingMessage(STATE_KIND, 0, export.chunk(offset, length), said | {"offset": offset},
                               frame_digests=export.digests_of(offset, length))

    def _sketch(self, peer: bytes, export: StateExport, seed, count, said: dict) -> OutgoingMessage:
        """The export's values at the elements `sketch_indices(seed, ..., count)` names; the
        export stays pinned for `peer`, as after a range that is not the last (a joiner asks
        sketches of several members, then downloads one of the states it saw)."""
        if type(seed) is not int or type(count) is not int or not 0 <= seed < 1 << 63 \
                or not 0 < count <= SKETCH_MAX_VALUES:
            raise Refusal(Reason.MALFORMED, f"a sketch request names a seed (0 to 2^63) and a count "
                                            f"of values (1 to {SKETCH_MAX_VALUES})")
        self._pin(peer, export, done=False)
        values = export.sample(sketch_indices(seed, export.total // FP32_BYTES, count))
        # in parts no larger than the model's largest tensor, as ranges are (the swarm's wire
        # limits bound a tensor's elements by it); the receiver reads their bytes in order
        largest = max(t.data.nbytes for t in export.tensors) // FP32_BYTES
        parts = [values[at:at + largest] for at in range(0, len(values), largest)]
        return OutgoingMessage(STATE_KIND, 0, [OutgoingTensor(f"sketch/{k}", "float32", part.shape, part)
                                               for k, part in enumerate(parts)], said | {"sketch": seed})

    def _pin(self, peer: bytes, export: StateExport, done: bool) -> None:
        """`peer` downloads `export` (until `done`); the pins of older exports kept in bound."""
        if done:
            self._pinned.pop(peer, None)
        else:
            self._pinned[peer] = export
        older = sorted({id(e): e for e in self._pinned.values() if e is not self.latest}.values(),
                       key=lambda e: e.round)
        for dropped in older[:max(0, len(older) - PINNED_OLDER)]:
            self._pinned = {p: e for p, e in self._pinned.items() if e is not dropped}

