"""A cached view of the swarm's members, refreshed from the DHT in the background, and our own record.

The matching and the DiLoCoX group read members on every decision; a DHT query each time would
put network latency in their path, so they read this cache instead. A lookup fetches every
member's record, so its cadence follows demand: every `refresh_s` while a decision waits on the
view (a caller of `want_fresh`: a node looking for a partner, a vote being counted, --min-peers),
every `idle_refresh_s` otherwise (one heartbeat: what a record changes by on its own).
`eligible()` is the one answer to "whom may this node pair with, send to, count the vote of or
download state from". Our own record's changes are published in the background, in the order
they were made; `PhiAnnouncer` keeps the digest of our φ in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from node.config.settings import NodeTimeouts
from node.events import PairCorrected, RoundEnded
from node.daemon.newcomers import NewcomerGate
from node.loop import BackgroundTasks
from node.rounds.contributions import BanList
from node.rounds.state import announcement
from p2p.records import MemberRecord
from p2p.version import incompatibility

log = logging.getLogger("lowcomm.members")
REMEMBERED_ADDRESSES = 64  # members whose addresses a node keeps to redial, the latest seen
TOLD_INCOMPATIBLE = 256     # members of another wire version already logged, the latest seen


class MemberCache:
    def __init__(self, membership, tasks: BackgroundTasks, *, manifest: str, bans: BanList,
                 refresh_s: float, admit: Callable[[str], bool] | None = None,
                 gate: NewcomerGate | None = None, vouch_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic, idle_refresh_s: float | None = None):
        """`manifest`: our manifest's digest; `admit`: in an allowlist swarm, records of unlisted
        keys are left out of the view, so nothing here ever pairs with or sends to them; `gate`:
        new identities become eligible at its rate only (admission.new_members_per_hour);
        `vouch_s`: how long a member whose signed stream came stays in the view (`vouch`);
        `clock`: the monotonic clock the records' `live_until` is on (Membership.clocks);
        `idle_refresh_s`: the lookups' cadence while nobody `want_fresh` (default `refresh_s`)."""
        self.membership, self.tasks, self.manifest, self.bans = membership, tasks, manifest, bans
        self.refresh_s, self.admit, self.gate, self.vouch_s = refresh_s, admit, gate, vouch_s
        self.clock = clock
        self.idle_refresh_s = refresh_s if idle_refresh_s is None else max(refresh_s, idle_refresh_s)
        self._wanted_until = -float("inf")  # on `clock`: until then the fast cadence holds
        self._wanted = asyncio.Event()
        self.records: dict[str, MemberRecord] = {}
        self.vouched: dict[str, float] = {}  # peer id -> until when its messages say it is alive
        # peer id -> addresses of the members last seen, kept after their records leave the
        # view: what the Reconnector redials (a node that lost its routing table before its
        # first round had none to redial, and stayed alone a minute: CI, 2026-11-26)
        self.addresses: dict[str, tuple[str, ...]] = {}
        self.extra: dict[str, Any] = {}  # our record's small fields, merged here in call order
        self.incompatible: dict[str, int] = {}  # peer id -> the wire version its record named
        self.refreshed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._updates: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.refresh()
        self._task = self.tasks.spawn(self._loop(), "member cache")

    async def stop(self, timeout_s: float) -> None:
        """Stops refreshing; waits (bounded) for our record's last changes to be published."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._updates:
            await asyncio.wait(self._updates, timeout=timeout_s)

    async def refresh(self) -> None:
        records = await self.membership.peers()
        now = self.clock()
        self.vouched = {peer: until for peer, until in self.vouched.items() if until > now}
        # a member whose record the lookup missed but whose stream just came stays in the view,
        # unless the lookup found it left
        kept = {peer: self.records[peer] for peer in self.vouched
                if peer in self.records and peer not in self.membership.left}
        records = self._compatible({**kept, **records})
        self.records = records if self.admit is None else \
            {peer: record for peer, record in records.items() if self.admit(peer)}
        for peer, record in self.records.items():
            self.addresses.pop(peer, None)  # re-inserted last: the oldest seen go first
            self.addresses[peer] = record.addrs
        while len(self.addresses) > REMEMBERED_ADDRESSES:
            del self.addresses[next(iter(self.addresses))]
        self.refreshed.set()

    def _compatible(self, records: dict[str, MemberRecord]) -> dict[str, MemberRecord]:
        """Records of members speaking this node's wire protocol; each other member's sentence
        (p2p/version.py) is logged once per version it names. Such a member is not in the view:
        never paired with, sent to or counted, nor redialled."""
        kept = {}
        for peer, record in records.items():
            refused = incompatibility(peer, record.wire)
            if refused is None:
                kept[peer] = record
            elif self.incompatible.get(peer) != record.wire:
                self.incompatible.pop(peer, None)
                self.incompatible[peer] = record.wire
                while len(self.incompatible) > TOLD_INCOMPATIBLE:
                    del self.incompatible[next(iter(self.incompatible))]
                log.warning("%s; it is left out of this node's member view", refused)
        return kept

    def want_fresh(self) -> None:
        """A decision waits on the view: look up now (if the idle cadence was on) and every
        `refresh_s` for the next `idle_refresh_s`; callers that poll call it on every poll."""
        idle = self.clock() >= self._wanted_until
        self._wanted_until = self.clock() + self.idle_refresh_s
        if idle:
            self._wanted.set()

    async def _loop(self) -> None:
        failing_since = None
        while True:
            if self.clock() < self._wanted_until:
                await asyncio.sleep(self.refresh_s)
            else:
                self._wanted.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._wanted.wait(), self.idle_refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # the DHT can hiccup; the next refresh retries
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.info("member lookups failing (%s); members expire from the view on time "
                             "and the node redials once it sees none", exc)
                continue
            if failing_since is not None:
                log.info("member lookups answer again after %.0f s", time.monotonic() - failing_since)
                failing_since = None

    def peers(self) -> list[MemberRecord]:
        """Members whose records have not expired. A refresh that fails (the DHT unreachable
        behind a cut link) keeps the last answer: filtering here lets those members expire on
        time, so the node sees itself alone and the Reconnector redials (measured: a node
        behind a cut link saw 2 peers alive for 80 s and never paired again)."""
        now = self.clock()
        return [record for record in self.records.values()
                if record.live_until > now or self.vouched.get(record.peer_id, 0.0) > now]

    def vouch(self, peer: str) -> None:
        """A stream whose head `peer` signed just came to us (Transport.on_heard): it is alive,
        whatever the DHT says, for `vouch_s` more (if we know its record). On a link saturated
        by its own pushes, a node's DHT lookups lagged, its members' records left its view while
        their messages kept coming, and it sent its round's message to no one
        (benchmarks/NOTEBOOK.md, "A diverged DiLoCoX node replays its steps", the 512 kbit/s runs).
        A member that stops sending still expires on time."""
        if peer in self.records:
            self.vouched[peer] = self.clock() + self.vouch_s

    def eligible(self) -> list[MemberRecord]:
        """The members this node may pair with, send to, count the vote of or download state
        from: live (`peers`), on our manifest (which fixes the protocol too), not banned, and
        past the newcomer gate where the swarm has one."""
        records = [record for record in self.peers()
                   if record.manifest == self.manifest and not self.bans.is_banned(record.peer_id)]
        if self.gate is None:
            return records
        admitted = self.gate.admit(record.peer_id for record in records)
        return [record for record in records if record.peer_id in admitted]

    def admitted(self, peer: str) -> bool:
        """Whether the newcomer gate (if any) lets `peer` in: a proposal from one it holds back
        is declined as ineligible."""
        return self.gate is None or self.gate.is_admitted(peer)

    def update(self, **fields: Any) -> None:
        """Publishes changes of our own record without waiting (order is kept by Membership).

        `extra` fields are merged with the ones set before, so that one caller's digest does not
        erase another's join round."""
        if "extra" in fields:
            self.extra = {**self.extra, **fields["extra"]}
            fields["extra"] = dict(self.extra)
        task = self.tasks.spawn(self.membership.update(**fields), "member record update")
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)


class Reconnector:
    """Redials the swarm when this node has seen no other member for `alone_s` seconds.

    After a link outage longer than the DHT's timeouts, both sides have dropped each other and
    nothing bootstraps again by itself: the node would train alone for good. Every
    `interval_s` while alone it dials its initial peers and the members the cache last saw
    (P2PHost.reconnect), however long ago. A node that starts a swarm alone dials nobody.
    """

    def __init__(self, host, cache: MemberCache, timeouts: NodeTimeouts):
        self.host, self.cache = host, cache
        self.alone_s, self.interval_s = timeouts.alone_before_redial_s, timeouts.redial_every_s
        self._alone_since: float | None = None
        self._next_try = 0.0
        self._task: asyncio.Task | None = None

    def check(self) -> None:
        """Call now and then from the event loop (cheap)."""
        now = asyncio.get_running_loop().time()
        others = self.cache.peers()
        if others:
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = now
        busy = self._task is not None and not self._task.done()
        if now - self._alone_since < self.alone_s or now < self._next_try or busy:
            return
        candidates = [*self.host.initial_peers,
                      *(a if "/p2p/" in a else f"{a}/p2p/{peer}"
                        for peer, addrs in self.cache.addresses.items() for a in addrs)]
        if not candidates:
            return
        self._next_try = now + self.interval_s
        self._task = self.cache.tasks.spawn(self._redial(candidates, self._alone_since), "redial")

    async def _redial(self, candidates: list[str], alone_since: float) -> None:
        """`alone_since`: since when this node has seen no other member (the loop's clock); passed
        in, since a member seen while the dials run resets `_alone_since`."""
        answered = await self.host.reconnect(candidates)
        log.info("no other member seen for %.0f s: redialled %d address(es), %d answered",
                 asyncio.get_running_loop().time() - alone_since, len(candidates), answered)
        if answered:
            await self.cache.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class PhiAnnouncer:
    """Keeps the digest of our φ in our member record (node/rounds/state.py announcement): what
    late joiners verify a downloaded state against, and DiLoCoX's consensus check counts.
    Subscribes to RoundEnded and PairCorrected."""

    def __init__(self, cache: MemberCache):
        self.cache = cache

    def __call__(self, event: RoundEnded | PairCorrected) -> None:
        digest = event.outcome.phi_digest if isinstance(event, RoundEnded) else event.phi_digest
        self.cache.update(extra=announcement(digest, event.round, self.cache.extra))
