"""The member cache's view when the DHT stops answering, and the --min-peers wait it feeds (the
real DHT path is covered by tests/integration/test_fault_points.py's cut link; these stand-ins
let a unit test choose exactly what each lookup answers).

Every test runs on virtual time (tests/virtual_time.py), and the cache's own clock is injected
where records expire: no test asserts a window of wall-clock time."""

import asyncio
import time

import pytest

from node.daemon.members import MemberCache
from node.loop import BackgroundTasks
from node.rounds.contributions import BanList
from p2p.errors import HostError
from p2p.records import MemberRecord
from tests.virtual_time import run


class LookupThatFailsAfterOneAnswer:
    """Stands in for p2p.membership.Membership: one answer, then every lookup times out."""

    left: frozenset[str] = frozenset()

    def __init__(self, records: dict[str, MemberRecord]):
        self.records, self.calls = records, 0

    async def peers(self) -> dict[str, MemberRecord]:
        self.calls += 1
        if self.calls > 1:
            raise HostError("the DHT did not answer a member lookup within 10 s.")
        return self.records


class ManualClock:
    """The cache's monotonic clock, moved by the test: no window of wall-clock time."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(peer: str, live_until: float) -> MemberRecord:
    return MemberRecord(peer, (), "noloco", "m", 3, "ready", 0.0, live_until=live_until)


async def lookups_made(lookup, count: int, timeout_s: float = 5.0) -> None:
    """Waits (bounded) until the cache's background loop has made `count` lookups."""
    async with asyncio.timeout(timeout_s):
        while lookup.calls < count:
            await asyncio.sleep(0.01)


def test_members_expire_on_time_while_refreshes_fail():
    async def scenario():
        clock = ManualClock()
        lookup = LookupThatFailsAfterOneAnswer({"a": record("a", clock.now + 0.6),
                                                "b": record("b", clock.now + 60)})
        cache = MemberCache(lookup, BackgroundTasks(), manifest="m", bans=BanList(2, 60.0),
                            refresh_s=0.01, clock=clock)
        await cache.start()
        assert {r.peer_id for r in cache.peers()} == {"a", "b"}
        await lookups_made(lookup, 3)  # two failed refreshes
        clock.now += 1.0
        await cache.stop(5.0)
        # "a" expired although no refresh succeeded; "b" is still alive; both stay known
        assert [r.peer_id for r in cache.peers()] == ["b"]
        assert set(cache.records) == {"a", "b"}
    run(scenario())


class LookupThatLosesRecords:
    """Stands in for p2p.membership.Membership: one answer, then answers without anyone (the
    lookups of a node on a saturated link found none of its members' fresh records), or with
    the tombstones of `leaving` from the third lookup on."""

    def __init__(self, records: dict[str, MemberRecord], leaving: frozenset[str] = frozenset()):
        self.records, self.calls, self.leaving, self.left = records, 0, leaving, frozenset()

    async def peers(self) -> dict[str, MemberRecord]:
        self.calls += 1
        self.left = self.leaving if self.calls >= 3 else frozenset()
        return self.records if self.calls == 1 else {}


def test_a_member_whose_message_came_stays_in_the_view_while_lookups_miss_it():
    async def scenario():
        clock = ManualClock()
        soon = clock.now + 0.3
        cache = MemberCache(LookupThatLosesRecords({"a": record("a", soon), "b": record("b", soon)}),
                            BackgroundTasks(), manifest="m", bans=BanList(2, 60.0), refresh_s=60.0,
                            vouch_s=0.6, clock=clock)
        await cache.refresh()
        cache.vouch("a")  # a's message came; nothing from b
        cache.vouch("stranger")  # no record of it: nothing to keep
        await cache.refresh()  # the lookup lost both records
        clock.now += 0.35  # and their own expiry passed
        assert [r.peer_id for r in cache.peers()] == ["a"] and "stranger" not in cache.vouched
        clock.now += 0.3  # no message from a since: it expires on time
        await cache.refresh()
        assert cache.peers() == [] and cache.records == {}
        # a member that left is dropped at its tombstone, streams or not
        cache = MemberCache(LookupThatLosesRecords({"a": record("a", soon + 60)}, leaving=frozenset({"a"})),
                            BackgroundTasks(), manifest="m", bans=BanList(2, 60.0), refresh_s=60.0,
                            clock=clock)
        await cache.refresh()
        cache.vouch("a")
        await cache.refresh()
        assert [r.peer_id for r in cache.peers()] == ["a"]
        cache.vouch("a")
        await cache.refresh()  # its tombstone
        assert cache.peers() == []
    run(scenario())


class HostThatRecordsRedials:
    """Stands in for p2p.host.P2PHost: records the addresses redialled, none answers."""

    def __init__(self):
        self.initial_peers, self.redialled = [], []

    async def reconnect(self, maddrs) -> int:
        self.redialled.append(list(maddrs))
        return 0


def test_a_member_seen_only_before_the_first_check_is_still_redialled():
    """The first node of a swarm has no initial peers: a member it saw while waiting for
    --min-peers and lost before training began must still be redialled once it is alone
    (without it the node stayed alone, CI 2026-11-26)."""
    from node.config.settings import NodeTimeouts
    from node.daemon.members import Reconnector

    async def scenario():
        clock = ManualClock()
        seen = MemberRecord("b", ("/ip4/127.0.0.1/tcp/4001",), "noloco", "m", 0, "ready", 0.0,
                            live_until=clock.now + 0.2)
        cache = MemberCache(LookupThatFailsAfterOneAnswer({"b": seen}), BackgroundTasks(),
                            manifest="m", bans=BanList(2, 60.0), refresh_s=60.0, clock=clock)
        await cache.refresh()
        clock.now += 0.3  # its record expired before the reconnector ever looked
        assert cache.peers() == []
        host = HostThatRecordsRedials()
        reconnector = Reconnector(host, cache, NodeTimeouts(alone_before_redial_s=0.0))
        reconnector.check()
        async with asyncio.timeout(5.0):  # bounded, on the loop's virtual clock
            while not host.redialled:
                await asyncio.sleep(0.01)
        await reconnector.stop()
        assert host.redialled == [["/ip4/127.0.0.1/tcp/4001/p2p/b"]]
    run(scenario())


class LookupThatGrows:
    """Stands in for p2p.membership.Membership: each lookup answers one more of `records`."""

    left: frozenset[str] = frozenset()

    def __init__(self, records: list[MemberRecord]):
        self.records, self.calls = records, 0

    async def peers(self) -> dict[str, MemberRecord]:
        self.calls += 1
        return {r.peer_id: r for r in self.records[:self.calls]}


def test_the_min_peers_wait_reports_members_it_sees_but_does_not_count():
    """A member banned before round 0 is seen but never counted: the wait says so (one event a
    change, which the status view's peer counts follow) and ends at its timeout; once enough
    eligible members come it ends at once."""
    from types import SimpleNamespace

    from node.daemon.join import wait_min_peers
    from node.events import EventBus, MinPeersTimeout, WaitingForPeers
    from node.ops.status import NodeStatus
    from node.ops.status_feed import StatusFeed

    async def wait(records: list[MemberRecord], banned: str | None, timeout_s: float):
        bus, seen = EventBus(), []
        bus.subscribe(seen.append, WaitingForPeers, MinPeersTimeout)
        feed = StatusFeed(NodeStatus(), param_bytes=4, snapshot_sets=1, traffic=lambda: (0, 0),
                          peers_known=lambda: 0)
        feed.subscribe(bus)
        bans = BanList(1, 60.0)
        if banned:
            bans.refuse(banned, "BUSY", "held too many streams", lambda peer, seconds: None)
        cache = MemberCache(LookupThatGrows(records), BackgroundTasks(), manifest="m", bans=bans,
                            refresh_s=0.05)
        await cache.start()
        loop = asyncio.get_running_loop()
        node = SimpleNamespace(settings=SimpleNamespace(min_peers=2, min_peers_timeout_s=timeout_s),
                               loop=loop, stop_event=asyncio.Event(), events=bus)
        began = loop.time()
        await wait_min_peers(node, cache)
        waited = loop.time() - began
        await cache.stop(1.0)
        return [e.record() for e in seen], feed.status, waited

    later = time.monotonic() + 3600
    members = [record(p, later) for p in ("a", "bad", "c")]
    events, status, waited = run(wait(members[:2], "bad", 0.5))
    assert [{k: e[k] for k in ("event", "eligible", "alive", "known")} for e in events[:2]] == [
        {"event": "waiting_for_peers", "eligible": 1, "alive": 1, "known": 1},
        {"event": "waiting_for_peers", "eligible": 1, "alive": 2, "known": 2}]
    assert events[-1]["event"] == "min_peers_timeout" and events[-1]["found"] == 1
    assert (status.peers_alive, status.peers_known) == (2, 2) and waited == pytest.approx(0.5)
    events, _, waited = run(wait(members, None, 30.0))
    # the second lookup, one refresh (0.05 s) after the first, brings the second eligible member
    assert [e["eligible"] for e in events] == [1, 2] and waited == pytest.approx(0.05)


class CountingLookup:
    """Stands in for p2p.membership.Membership: counts lookups, answers nobody."""

    left: frozenset[str] = frozenset()

    def __init__(self):
        self.calls = 0

    async def peers(self) -> dict[str, MemberRecord]:
        self.calls += 1
        return {}


def test_lookups_follow_demand_fast_while_a_decision_waits_and_at_the_idle_cadence_otherwise():
    """Nothing waits: no lookup within 0.2 s at a fast cadence of 0.01 s. `want_fresh` looks up
    at once and every 0.01 s until its window, on the injected clock, has passed; then the
    lookups stop again."""
    async def scenario():
        clock, lookup = ManualClock(), CountingLookup()
        cache = MemberCache(lookup, BackgroundTasks(), manifest="m", bans=BanList(2, 60.0),
                            refresh_s=0.01, idle_refresh_s=3600.0, clock=clock)
        await cache.start()  # its first lookup
        await asyncio.sleep(0.2)
        assert lookup.calls == 1, "the cache looked up while nothing waited on it"
        cache.want_fresh()
        await lookups_made(lookup, 6)
        clock.now += 3600.0  # the wait is over: no caller asked again
        await lookups_made(lookup, lookup.calls + 1)  # the iteration that sees it
        settled = lookup.calls
        await asyncio.sleep(0.2)
        assert lookup.calls == settled, "the fast cadence outlived its demand"
        await cache.stop(1.0)
    run(scenario())
