"""A DiLoCoX node's downlink load: how long the messages of one round need to come in through
its link, against one of its rounds; published in its member record ("downlink") and read by
every sender's controller (sending.py `send_ratio`, node/rounds/dilocox/adapt.py).

Every member sends its message to every other, so a member on a slow link receives N − 1
messages a round through one downlink, while each sender measures only its own sends. In R14
(benchmarks/RESULTS.md, issue 18) three fast nodes each saw their sends within budget, raised
their ranks in the same rounds and sent 3 × 391 KiB a round, 18 s of the 512 kbit/s node's
downlink against 12 s rounds: that node fell behind, and the others waited up to 10 s for it.

    rate      = the fastest of the last LINK_MEMORY rounds' messages (of at least MIN_BYTES,
                bytes / seconds from its first frame to its last) and of those rounds' messages
                together (their bytes / the time any of them was coming in)
    load(r)   = (bytes of round r's messages) / rate / (our shortest recent round)
    published = the worst load of the last LINK_MEMORY rounds

The downlink carries at least the fastest of these: a message from a slow sender comes slower
than the receiver's link (it does not count against it, since a faster one shows the link), and
messages that share the link come slower each, but not together. Small messages are left out
of the first: their seconds are mostly the stream's latency.

A member's published load counts for a sender as if that receiver's downlink were its own link
(`receiver_load`): every sender's message crosses it, so all shrink together. Values that are
not numbers in [0, MAX_LOAD] are ignored; a member that lies can make its senders compress down
to the manifest's floor (what a slow member would ask for), not stall them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from node.rounds.dilocox.sending import LINK_MEMORY

MIN_BYTES = 32 * 1024
MAX_LOAD = 1000.0
RECORD_KEY = "downlink"


class DownlinkMeter:
    """The messages of our rounds as they come; the load of each round when it is collected."""

    def __init__(self) -> None:
        self._rates: list[tuple[int, float]] = []  # (round, bytes per second) measured
        self._bytes: dict[int, int] = {}           # round -> bytes received so far
        self._spans: dict[int, list[tuple[float, float, int]]] = {}  # round -> (start, end, bytes)
        self._loads: tuple[float, ...] = ()        # of the last LINK_MEMORY collected rounds

    def arrived(self, round_index: int, nbytes: int, seconds: float, at: float | None = None) -> None:
        """A message of `round_index` came at `at` (now): `nbytes` in `seconds` (0: not over a
        stream)."""
        self._bytes[round_index] = self._bytes.get(round_index, 0) + nbytes
        if seconds > 0:
            end = time.monotonic() if at is None else at
            self._spans.setdefault(round_index, []).append((end - seconds, end, nbytes))
            if nbytes >= MIN_BYTES:
                self._rate(round_index, nbytes / seconds)

    def _rate(self, round_index: int, rate: float) -> None:
        self._rates = [(r, x) for r, x in self._rates if r > round_index - LINK_MEMORY]
        self._rates.append((round_index, rate))

    def collected(self, round_index: int, round_s: float) -> float | None:
        """`round_index`'s messages are in (or given up): its load over one round of `round_s`
        seconds; the worst of the last LINK_MEMORY such loads is `load` from now on. None (and
        nothing kept) before a large message measured the link or a round was measured."""
        received = self._bytes.pop(round_index, 0)
        spans = self._spans.pop(round_index, [])
        for table in (self._bytes, self._spans):
            for old in [r for r in table if r < round_index]:
                del table[old]
        together = sum(nbytes for _, _, nbytes in spans)
        if together >= MIN_BYTES:
            self._rate(round_index, together / _covered(spans))
        rates = [rate for r, rate in self._rates if r > round_index - LINK_MEMORY]
        if not rates or round_s <= 0:
            return None
        load = received / max(rates) / round_s
        self._loads = (*self._loads, load)[-LINK_MEMORY:]
        return load

    @property
    def load(self) -> float | None:
        """The worst load of the last LINK_MEMORY collected rounds (None before the first)."""
        return max(self._loads) if self._loads else None


def _covered(spans: list[tuple[float, float, int]]) -> float:
    """Seconds in which at least one of the spans was under way."""
    covered, reach = 0.0, -math.inf
    for start, end, _ in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def receiver_load(records: Iterable, senders_to: set[str]) -> float:
    """The largest valid downlink load among the member records of `senders_to` (0 if none)."""
    loads = [r.extra.get(RECORD_KEY) for r in records if r.peer_id in senders_to]
    valid = [float(x) for x in loads if isinstance(x, (int, float)) and not isinstance(x, bool)
             and math.isfinite(x) and 0 <= x <= MAX_LOAD]
    return max(valid, default=0.0)
