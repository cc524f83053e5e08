"""When a transfer ends: done, stalled, or unable to finish in time. Never at a fixed time.

A `Progress` counts the bytes one exchange moved over all its streams, both ways (a message
split over parallel streams progresses while any of them moves; a swap while either half does),
and gives the two verdicts that end an exchange which is not done:

- stalled: no byte moved, on any of its streams, either way, for `TransferLimits.stall_s`;
- too slow: its need-by passed with bytes still to move; or, once it has run for one stall
  bound (its rate is then a measurement), its remaining bytes could not arrive by its need-by
  even if each direction went on at the better of the rate it has moved at so far and the
  swarm's minimum link rate (`TransferLimits.min_rate_bytes_per_s`).
  The need-by is the caller's (`NeedBy`: what its logic can still use, e.g. the rounds a NoLoCo
  swap may take) or by default what its bytes take at the minimum rate plus one stall's worth
  (`TransferLimits.need_by_s`). A peer trickling a byte every few seconds is cut by this rule,
  not by a constant; one on a link at the swarm's minimum rate is never cut by the default
  need-by; and a transfer whose link is faster than the minimum is judged at its own rate, so a
  caller's short need-by cuts it only when its own progress shows it cannot make it.

Once every byte of ours left, the answer (the receiver's status) may wait on bytes still in the
link: such an exchange ends at its need-by, or a stall's worth after our last byte if that is
later, where the caller gave no need-by of its own.

Every read and drain of a stream waits through `Progress.wait`, which re-checks both verdicts
while it waits; `p2p/assembly.py` arms a timer on them for an incoming message, whose streams may
not all have an operation pending. Both raise the verdict as a `Refusal(TIMEOUT)` whose detail
says what happened in one sentence ("no byte moved for 30 s", "at 0.4 Mbit/s it could not finish
48 MB within the 3 rounds it may take").
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from p2p.counters import TransportCounters
from p2p.errors import Reason, Refusal
from p2p.limits import TransferLimits

T = TypeVar("T")
# A stall while at least this much came on our other streams: our downlink was full, not the
# peer silent (the refusal is marked congested: no strike). Measured: a node on 512 kbit/s saw
# honest members' pushes idle 30 s behind a state download, struck them TIMEOUT and banned all
# three for 600 s (benchmarks/NOTEBOOK.md, "The same slow-link DiLoCoX run with relayed
# messages", run C).
CONGESTED_BYTES = 64 << 10
# the verdicts are re-checked at most this often, in stalls (a check cadence, not a bound)
CHECKS_PER_STALL = 30
# a writer's progress shows at least this often per stall at the minimum rate (`drain_bytes`)
DRAINS_PER_STALL = 4
MIN_DRAIN_BYTES = 16 << 10


@dataclass(frozen=True)
class NeedBy:
    """The caller's need-by: `seconds` from the exchange's start, after which it is of no use;
    `why` completes "it could not finish 48 MB within ..." (default: the seconds)."""

    seconds: float
    why: str = ""

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"a need-by must be positive, got {self.seconds!r} s.")

    @property
    def words(self) -> str:
        return self.why or f"{self.seconds:.0f} s"


class Progress:
    """Bytes one exchange moved, both ways, and the verdicts that end it (module docstring)."""

    def __init__(self, limits: TransferLimits, *, sending: int = 0, receiving: int = 0,
                 need_by: NeedBy | None = None, sharing: int = 0, counters: TransportCounters | None = None,
                 rate_bound: bool = True, clock: Callable[[], float] = time.monotonic):
        """`sharing`: bytes that share the link with this exchange (all that a receiver is
        receiving: the default need-by covers them all at the minimum rate). `rate_bound` False:
        the stall verdict alone, whatever moved (a stream before its message is known, a
        forwarded stream)."""
        self.limits, self.need_by, self.counters, self.clock = limits, need_by, counters, clock
        self.rate_bound, self.sharing = rate_bound, sharing
        self.started = self.last_moved = clock()
        self.sending, self.receiving = sending, receiving
        self.sent = self.received = 0
        self._others_mark = counters.bytes_received if counters else 0
        self.failure: Refusal | None = None
        self.too_slow = False

    # ------------------------------------------------------------------ counting
    def expect(self, *, sending: int | None = None, receiving: int | None = None) -> None:
        """The exchange's size each way, once known (a reply's, from its first header)."""
        if sending is not None:
            self.sending = sending
        if receiving is not None:
            self.receiving = receiving

    def moved(self, *, sent: int = 0, received: int = 0) -> None:
        if sent or received:
            self.sent += sent
            self.received += received
            self.last_moved = self.clock()
            if self.counters is not None:
                self._others_mark = self.counters.bytes_received

    # ------------------------------------------------------------------ verdicts
    @property
    def remaining(self) -> int:
        return max(self.sending - self.sent, self.receiving - self.received, 0)

    @property
    def need_by_at(self) -> float:
        seconds = (self.need_by.seconds if self.need_by is not None
                   else self.limits.need_by_s(max(self.sending, self.receiving, self.sharing)))
        return self.started + seconds

    def verdict(self, now: float) -> Refusal | None:
        """The refusal that ends the exchange at `now`, or None while it may go on."""
        if self.failure is not None:
            return self.failure
        if now >= self._answer_due():
            self.too_slow = True
            self.failure = Refusal(Reason.TIMEOUT, self._unanswered_sentence())
        elif self._moving() and now - self.last_moved >= self.limits.stall_s:
            self.failure = self._stalled()
        elif self.rate_bound and self.remaining and (now >= self.need_by_at or (
                now - self.started >= self.limits.stall_s
                and now + self._time_to_finish(now) > self.need_by_at)):
            self.too_slow = True
            # our own half behind: our link, not the peer, is the slow one (no strike for it)
            ours = self.sending - self.sent >= self.receiving - self.received
            self.failure = Refusal(Reason.TIMEOUT, self._too_slow_sentence(now), congested=ours)
        return self.failure

    def _time_to_finish(self, now: float) -> float:
        """Seconds the remaining bytes take, each direction at the better of its rate so far and
        the minimum rate (both directions travel at once: the slower one decides)."""
        elapsed = max(now - self.started, 1e-9)
        floor = self.limits.min_rate_bytes_per_s
        return max((size - done) / max(floor, done / elapsed)
                   for size, done in ((self.sending, self.sent), (self.receiving, self.received)))

    def _answer_due(self) -> float:
        """With every byte of ours moved, when the answer (a status) must have come: what we
        sent may still be in the link (buffers on the way hold megabytes, which a slow link
        drains for many seconds after our last write), so the exchange's need-by, and a stall's
        worth after our last byte; the caller's need-by alone where it gave one."""
        if self._moving():
            return math.inf
        if self.need_by is not None:
            return self.need_by_at
        return max(self.need_by_at, self.last_moved + self.limits.stall_s)

    def _moving(self) -> bool:
        """Bytes of the exchange are still to move (always, for a progress of unknown size)."""
        return bool(self.remaining) or not self.rate_bound

    def next_check(self, now: float) -> float:
        """When a verdict may next change (at the earliest one cadence from `now`)."""
        at = self._answer_due()
        if self._moving():
            at = self.last_moved + self.limits.stall_s
            if self.rate_bound:
                at = min(at, self.need_by_at, max(self.started + self.limits.stall_s,
                                                  self.need_by_at - self._time_to_finish(now)))
        return max(at, now + self.limits.stall_s / CHECKS_PER_STALL)

    def _stalled(self) -> Refusal:
        stall = f"no byte moved for {self.limits.stall_s:.0f} s"
        others = self.counters.bytes_received - self._others_mark if self.counters else 0
        if others >= CONGESTED_BYTES:
            return Refusal(Reason.TIMEOUT, f"{stall} while {others} bytes came on other streams "
                           f"(our link is saturated)", congested=True)
        return Refusal(Reason.TIMEOUT, stall)

    def _unanswered_sentence(self) -> str:
        why = self.need_by.words if self.need_by is not None else f"{self._answer_due() - self.started:.0f} s"
        return (f"its {_size(max(self.sending, self.receiving))} moved, but it was not answered "
                f"within {why}")

    def _too_slow_sentence(self, now: float) -> str:
        # the half that is behind is the one too slow: its rate is what the sentence gives
        theirs = self.receiving - self.received >= self.sending - self.sent
        moved, size = (self.received, self.receiving) if theirs else (self.sent, self.sending)
        rate = moved * 8 / max(now - self.started, 1e-9)
        why = (self.need_by.words if self.need_by is not None else
               f"the {self.need_by_at - self.started:.0f} s that the swarm's minimum link rate of "
               f"{_rate(self.limits.min_rate_bytes_per_s * 8)} allows for it")
        return f"at {_rate(rate)} it could not finish {_size(size)} within {why} ({_size(moved)} moved)"

    def drain_bytes(self) -> int:
        """The most bytes one drain may wait on: a writer sees its progress only when a drain
        returns, so a link at the minimum rate must drain this several times per stall (a 1 MiB
        drain at 0.25 Mbit/s takes 34 s, longer than the default stall bound)."""
        return max(MIN_DRAIN_BYTES, int(self.limits.min_rate_bytes_per_s * self.limits.stall_s
                                        / DRAINS_PER_STALL))

    # ------------------------------------------------------------------ waiting
    async def wait(self, start: Callable[[], Awaitable[T]]) -> T:
        """`await start()`, raising the verdict's Refusal if one ends the exchange meanwhile.

        `start` must make an operation that is safe to cancel and start again (a stream read
        or drain: nothing is consumed until it returns)."""
        while True:
            now = self.clock()
            refusal = self.verdict(now)
            if refusal is not None:
                raise refusal
            try:
                async with asyncio.timeout(self.next_check(now) - now):
                    return await start()
            except TimeoutError:
                continue


def _rate(bits_per_s: float) -> str:
    if bits_per_s >= 1e5:
        return f"{bits_per_s / 1e6:.2g} Mbit/s" if bits_per_s < 1e7 else f"{bits_per_s / 1e6:.0f} Mbit/s"
    return f"{bits_per_s / 1e3:.2g} kbit/s" if bits_per_s >= 1e3 else f"{bits_per_s:.0f} bit/s"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.3g} MB" if nbytes >= 100_000 else f"{nbytes} bytes"
