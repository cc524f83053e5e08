"""An operator's lever against a Sybil flood in an open swarm: a rate of new identities.

Peer ids cost nothing to mint, and NoLoCo pairs uniformly among eligible members, so S fresh
identities of one operator take about S/(S+H-1) of an honest node's pairs (benchmarks/NOTEBOOK.md,
"Sybil pressure"). With `admission.new_members_per_hour` = R > 0, a node lets identities it has
never seen become eligible (to pair with, send to, count the vote of, download state from, and
to accept a proposal from) at most R per hour: a token bucket of rate R/3600 per second and
burst max(1, R/12) (five minutes' worth), the waiting admitted in the order this node first saw
them (ties by id). What the node saw in its first view of the swarm (the first that holds
anyone) is admitted at once: it
cannot tell an old member from a new one then, so the lever protects members against a flood
that comes after them, not a joiner against one that came before it.

Cost, and what it does not do: honest newcomers wait in the same queue as the Sybils (with 64
Sybils queued and R = 6, an honest node joining after them waits ~11 hours to be a partner of
the members who saw the flood); identities admitted once stay admitted while remembered (the
last `remember` seen), so over time the Sybils' share climbs back towards S/(S+H-1) at R an hour.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

REMEMBER = 4096  # identities remembered (admitted or waiting): peer ids are free to mint


class NewcomerGate:
    def __init__(self, per_hour: float, clock: Callable[[], float] = time.monotonic,
                 remember: int = REMEMBER):
        if per_hour <= 0:
            raise ValueError(f"new members per hour must be > 0 for a gate, got {per_hour!r}: "
                             "0 means no gate, so build none")
        self.rate, self.burst = per_hour / 3600.0, max(1.0, per_hour / 12.0)
        self.clock, self.remember = clock, remember
        self.tokens, self.last = self.burst, clock()
        self.admitted: OrderedDict[str, None] = OrderedDict()
        self.waiting: OrderedDict[str, None] = OrderedDict()   # first seen, in order
        self.first_view = True

    def is_admitted(self, peer: str) -> bool:
        return peer in self.admitted

    def admit(self, peers: Iterable[str]) -> set[str]:
        """`peers` (a view of the swarm) less those still waiting; admits what the bucket allows."""
        seen = sorted(set(peers))
        if self.first_view and seen:
            self.first_view = False
            for peer in seen:
                self._remember(self.admitted, peer)
            return set(seen)
        for peer in seen:
            if peer not in self.admitted and peer not in self.waiting:
                self._remember(self.waiting, peer)
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        while self.waiting and self.tokens >= 1.0:
            peer, _ = self.waiting.popitem(last=False)
            self._remember(self.admitted, peer)
            self.tokens -= 1.0
        return {peer for peer in seen if peer in self.admitted}

    def _remember(self, table: OrderedDict, peer: str) -> None:
        table[peer] = None
        while len(table) > self.remember:
            table.popitem(last=False)
