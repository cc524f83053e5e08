"""A real Swarm (node/rounds/swarm.py) for unit tests of the exchanges, without a network.

Its member cache is the real MemberCache (so `eligible()` filters as in the daemon) over a
membership that answers no lookups and records our own record's updates; the records a test
wants the node to see go into `swarm.members.records`. Events are collected in `events`.
"""

from __future__ import annotations

import asyncio

from node.config.settings import NodeTimeouts
from node.daemon.members import MemberCache
from node.loop import BackgroundTasks, LoopBridge
from node.rounds.contributions import BanList
from node.rounds.state import StateLayout
from node.rounds.swarm import Swarm
from p2p.records import MemberRecord


class RecordedMembership:
    """Stands in for p2p.membership.Membership: no lookups, our updates kept in order."""

    left: frozenset[str] = frozenset()

    def __init__(self):
        self.updates: list[dict] = []

    async def peers(self) -> dict[str, MemberRecord]:
        return {}

    async def update(self, **fields) -> None:
        self.updates.append(fields)


def member(peer_id: str, round_index: int, protocol: str = "noloco", status: str = "ready",
           manifest: str = "m", **extra) -> MemberRecord:
    """A live member record (built by hand: alive until a test replaces it)."""
    return MemberRecord(peer_id, (), protocol, manifest, round_index, status, 0.0, dict(extra))


UNIT_LAYOUT = StateLayout((("w", (4,)),))  # a state's bytes, for a resync that downloads one


def unit_swarm(loop: asyncio.AbstractEventLoop, records=(), *, peer_id: str = "me",
               transport=None, events: list | None = None, bans: BanList | None = None) -> Swarm:
    """A Swarm whose member cache holds `records`; published events are appended to `events`."""
    publish = events.append if events is not None else (lambda event: None)
    tasks = BackgroundTasks(publish)
    bans = bans if bans is not None else BanList(2, 60.0)
    cache = MemberCache(RecordedMembership(), tasks, manifest="m", bans=bans,
                        refresh_s=NodeTimeouts().member_refresh_s)
    cache.records = {r.peer_id: r for r in records}
    return Swarm(loop, transport, cache, bans, peer_id, "m", LoopBridge(loop, tasks, 30.0), tasks,
                 publish, NodeTimeouts(), state_layout=UNIT_LAYOUT)
