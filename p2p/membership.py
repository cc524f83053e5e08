"""Swarm membership on the DHT: one owner-signed subkey per member, refreshed by a heartbeat.

    membership = Membership(host, swarm="demo", protocol="noloco", manifest=digest, ttl_s=30)
    await membership.start()                    # publishes our record, starts the heartbeat
    await membership.update(round=5, status="ready", throughput=1234.0, extra={"phi": "ab12"})
    members = await membership.peers()          # {peer id: MemberRecord} of live members
    await membership.leave()                    # tombstone: others drop us at once

Clocks differ between members, and no member's clock is trusted by another:
- a writer stores each heartbeat with a DHT expiration `lifetime_s` = `ttl_s` + `skew_tolerance_s`
  past its own clock, so DHT nodes whose clocks differ from it by up to `skew_tolerance_s` keep it
  (hivemind's storage drops a record whose expiration is past by the storing node's clock);
- a reader judges liveness on its own monotonic clock: a member is alive for `ttl_s` after the
  reader first saw its latest heartbeat (each heartbeat's signed expiration is later than the one
  before, so a new one is told from a repeat of the old). A member that dies vanishes `ttl_s`
  after the reader's first sight of its last heartbeat, whatever the writer's clock said.
There is no delete in hivemind's DHT, so a graceful leave stores a tombstone (status "left")
that expires later than any heartbeat before it and therefore replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

from p2p.errors import HostError
from p2p.host import P2PHost
from p2p.records import CLOCK_SKEW_TOLERANCE_S, STATUSES, MemberRecord

logger = logging.getLogger("lowcomm.p2p.membership")
_UPDATABLE = frozenset(("addrs", "protocol", "manifest", "round", "status", "throughput", "extra"))
REMEMBERED_BEATS = 4096  # members whose latest heartbeat a reader remembers (bounded memory)


@dataclass(frozen=True)
class Clocks:
    """The two clocks of a node: `wall` stamps what it writes (DHT expirations, `updated`);
    `monotonic` is what it judges others' liveness by. Injected in tests to skew a node."""

    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic


@dataclass(frozen=True)
class _Beat:
    expires: float   # the heartbeat's DHT expiration (the writer's clock, signed)
    seen: float      # when this reader first saw it (its monotonic clock)


def members_key(swarm: str) -> str:
    """The DHT key of a swarm's member dictionary."""
    return f"lowcomm/swarm/{swarm}/members"


class Membership:
    """This node's presence in one swarm, and its view of the other members."""

    def __init__(self, host: P2PHost, swarm: str, *, protocol: str, manifest: str, ttl_s: float = 30.0,
                 heartbeat_s: float | None = None, addrs: list[str] | None = None,
                 clocks: Clocks = Clocks(), skew_tolerance_s: float = CLOCK_SKEW_TOLERANCE_S):
        if not ttl_s > 0:
            raise ValueError(f"membership TTL must be positive, got {ttl_s!r}.")
        if not skew_tolerance_s >= 0:
            raise ValueError(f"the clock skew tolerance must not be negative, got {skew_tolerance_s!r}.")
        self.host, self.swarm, self.ttl_s = host, swarm, float(ttl_s)
        self.clocks, self.lifetime_s = clocks, self.ttl_s + float(skew_tolerance_s)
        self.heartbeat_s = float(heartbeat_s) if heartbeat_s is not None else self.ttl_s / 3
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"the heartbeat ({self.heartbeat_s} s) must be shorter than the TTL ({self.ttl_s} s).")
        self.key = members_key(swarm)
        self._peer = host.peer_id.to_base58()
        self._record = MemberRecord(self._peer, tuple(addrs or ()), protocol, manifest, 0, "joining", 0.0)
        self._heartbeat: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._last_expiration = 0.0
        self._beats: dict[str, _Beat] = {}  # peer id -> its latest heartbeat we saw
        self.left: frozenset[str] = frozenset()  # members whose tombstone the last lookup found
        host.validator.protect(self.key)

    @property
    def record(self) -> MemberRecord:
        """Our own record as last published."""
        return self._record

    async def start(self) -> None:
        """Publish our record and keep refreshing it every `heartbeat_s`.

        A DHT that has just bootstrapped can refuse the first store (its routing table is still
        filling, or the bootstrap peer is busy), so the first publish is retried with backoff
        for up to one TTL before the node gives up with one sentence.
        """
        if self._heartbeat is not None:
            return
        if not self._record.addrs:
            self._record = replace(self._record, addrs=tuple(await self.host.maddrs()))
        deadline, backoff = time.monotonic() + self.ttl_s, 0.25
        while not await self._publish():
            if time.monotonic() + backoff > deadline:
                raise HostError(f"could not store our membership record for swarm {self.swarm!r} "
                                f"in the DHT within {self.ttl_s:.0f} s: check that the bootstrap "
                                f"peers are reachable and running.")
            logger.warning("the DHT did not store our membership record of swarm %r; retrying in "
                           "%.2f s", self.swarm, backoff)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 4.0)
        self._heartbeat = asyncio.create_task(self._beat(), name=f"membership-heartbeat-{self.swarm}")

    async def update(self, **fields: Any) -> None:
        """Change fields of our record (round, status, throughput, extra, ...) and publish now."""
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"unknown member record fields {sorted(unknown)}; allowed: {sorted(_UPDATABLE)}.")
        if "status" in fields and fields["status"] not in STATUSES[:-1]:
            raise ValueError(f"status must be one of {STATUSES[:-1]} (use leave() to leave).")
        if "addrs" in fields:
            fields["addrs"] = tuple(fields["addrs"])
        self._record = replace(self._record, **fields)
        if not await self._publish():
            logger.warning("could not publish the membership update of swarm %r; the heartbeat will retry",
                           self.swarm)

    async def peers(self, include_self: bool = False, timeout_s: float = 10.0) -> dict[str, MemberRecord]:
        """Live members: validated, not tombstoned, and alive by our clock (a heartbeat first
        seen less than `ttl_s` ago; each record's `live_until` says until when, on
        `clocks.monotonic`); keyed by base58 peer id.

        Raises HostError if the DHT does not answer within `timeout_s`.
        """
        try:
            async with asyncio.timeout(timeout_s):
                # the latest record among the nodes that store it (the key's num_replicas nearest):
                # hivemind's default beam (bucket_size, 20) asked nearly every node of a small
                # swarm for the whole dictionary on every lookup
                found = await self.host.dht.get(self.key, latest=True, beam_size=self.host.dht.num_replicas)
        except TimeoutError:
            raise HostError(f"the DHT did not answer a member lookup of swarm {self.swarm!r} "
                            f"within {timeout_s:.0f} s.") from None
        if found is None or not isinstance(found.value, dict):
            return {}
        now = self.clocks.monotonic()
        members, left, found_ids = {}, set(), set()
        for subkey, entry in found.value.items():
            # The validator already checked that each subkey's owner signed its value.
            if type(subkey) is not str or (subkey == self._peer and not include_self):
                continue
            record = MemberRecord.from_value(subkey, entry.value, entry.expiration_time)
            if record is None:
                logger.debug("ignoring a malformed member record for %s", subkey)
            elif record.left:
                left.add(subkey)
            else:
                found_ids.add(subkey)
                live_until = self._seen(subkey, record.expires, now).seen + self.ttl_s
                if live_until > now:
                    members[subkey] = replace(record, live_until=live_until)
        self._forget_beats(found_ids, now)
        self.left = frozenset(left)
        return members

    def _seen(self, peer: str, expires: float, now: float) -> _Beat:
        """The latest heartbeat of `peer` we know, `expires` counted as new if it is later."""
        beat = self._beats.get(peer)
        if beat is None or expires > beat.expires:
            beat = self._beats[peer] = _Beat(expires, now)
        return beat

    def _forget_beats(self, found: set[str], now: float) -> None:
        """Forget the heartbeats of members this lookup did not find and that are dead by our
        clock anyway, then the oldest beyond REMEMBERED_BEATS."""
        for peer in [p for p, beat in self._beats.items() if p not in found and beat.seen + self.ttl_s <= now]:
            del self._beats[peer]
        while len(self._beats) > REMEMBERED_BEATS:
            del self._beats[min(self._beats, key=lambda p: self._beats[p].seen)]

    async def leave(self) -> None:
        """Stop the heartbeat and store a tombstone, so that peers drop us at once."""
        await self.stop()
        self._record = replace(self._record, status="left")
        if not await self._publish():
            logger.warning("could not store the tombstone of swarm %r; peers will drop us %s s after "
                           "our last heartbeat", self.swarm, self.ttl_s)

    async def stop(self) -> None:
        """Stop refreshing without a tombstone: peers drop us `ttl_s` after our last heartbeat."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                if not await self._publish():
                    logger.warning("membership heartbeat of swarm %r was not stored", self.swarm)
            except Exception:  # a heartbeat must never die: the next one retries
                logger.exception("membership heartbeat of swarm %r failed", self.swarm)

    async def _publish(self) -> bool:
        async with self._lock:
            # Strictly later than anything we stored before, so the DHT takes it (a tombstone
            # written right after a heartbeat must still replace it), and readers see a new beat.
            now = self.clocks.wall()
            expiration = max(now + self.lifetime_s, self._last_expiration + 1e-3)
            self._record = replace(self._record, updated=now, expires=expiration)
            try:
                stored = await asyncio.wait_for(
                    self.host.dht.store(self.key, self._record.to_value(), expiration, subkey=self._peer),
                    timeout=max(self.heartbeat_s, 5.0))
            except asyncio.TimeoutError:
                return False
            if stored:
                self._last_expiration = expiration
            return bool(stored)
