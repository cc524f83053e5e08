"""The member cache's view when the DHT stops answering (the real DHT path is covered by
tests/integration/test_fault_points.py's cut link; this stand-in lets a unit test choose
exactly when lookups fail)."""

import asyncio
import time

from node.daemon.members import MemberCache
from node.loop import BackgroundTasks
from node.rounds.contributions import BanList
from p2p.errors import HostError
from p2p.records import MemberRecord


class LookupThatFailsAfterOneAnswer:
    """Stands in for p2p.membership.Membership: one answer, then every lookup times out."""

    def __init__(self, records: dict[str, MemberRecord]):
        self.records, self.calls = records, 0

    async def peers(self) -> dict[str, MemberRecord]:
        self.calls += 1
        if self.calls > 1:
            raise HostError("the DHT did not answer a member lookup within 10 s.")
        return self.records


def record(peer: str, expires: float) -> MemberRecord:
    return MemberRecord(peer, (), "noloco", "m", 3, "ready", 0.0, expires=expires)


def test_members_expire_on_time_while_refreshes_fail():
    async def scenario():
        soon, later = time.time() + 0.6, time.time() + 60
        lookup = LookupThatFailsAfterOneAnswer({"a": record("a", soon), "b": record("b", later)})
        cache = MemberCache(lookup, BackgroundTasks(), manifest="m", bans=BanList(2, 60.0),
                            refresh_s=0.05)
        await cache.start()
        assert {r.peer_id for r in cache.peers()} == {"a", "b"}
        deadline = time.monotonic() + 5
        while len(cache.peers()) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await cache.stop(5.0)
        assert lookup.calls > 2, "the cache stopped refreshing"
        # "a" expired although no refresh succeeded; "b" is still alive; both stay known
        assert [r.peer_id for r in cache.peers()] == ["b"]
        assert set(cache.records) == {"a", "b"}
    asyncio.run(scenario())


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
        gone = time.time() + 0.2
        seen = MemberRecord("b", ("/ip4/127.0.0.1/tcp/4001",), "noloco", "m", 0, "ready", 0.0,
                            expires=gone)
        cache = MemberCache(LookupThatFailsAfterOneAnswer({"b": seen}), BackgroundTasks(),
                            manifest="m", bans=BanList(2, 60.0), refresh_s=60.0)
        await cache.refresh()
        await asyncio.sleep(0.3)  # its record expired before the reconnector ever looked
        assert cache.peers() == []
        host = HostThatRecordsRedials()
        reconnector = Reconnector(host, cache, NodeTimeouts(alone_before_redial_s=0.0))
        reconnector.check()
        deadline = time.monotonic() + 5
        while not host.redialled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await reconnector.stop()
        assert host.redialled == [["/ip4/127.0.0.1/tcp/4001/p2p/b"]]
    asyncio.run(scenario())
