"""A cached view of the swarm's members, refreshed from the DHT in the background.

The matching and the DiLoCoX group read members on every decision; a DHT query each time would
put network latency in their path, so they read this cache (at most `refresh_s` old) instead.
Our own record's changes are published in the background, in the order they were made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from p2p.records import MemberRecord

log = logging.getLogger("lowcomm.members")


class MemberCache:
    def __init__(self, membership, refresh_s: float = 0.5,
                 admit: Callable[[str], bool] | None = None):
        """`admit`: in an allowlist swarm, records of unlisted keys are left out of the view, so
        nothing here ever pairs with or sends to them."""
        self.membership, self.refresh_s, self.admit = membership, refresh_s, admit
        self.records: dict[str, MemberRecord] = {}
        self.extra: dict[str, Any] = {}  # our record's small fields, merged here in call order
        self.refreshed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._updates: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="member-cache")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._updates:
            await asyncio.wait(self._updates, timeout=5)

    async def refresh(self) -> None:
        records = await self.membership.peers()
        self.records = records if self.admit is None else \
            {peer: record for peer, record in records.items() if self.admit(peer)}
        self.refreshed.set()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # the DHT can hiccup; the next refresh retries
                log.debug("member refresh failed: %s", exc)

    def peers(self) -> list[MemberRecord]:
        return list(self.records.values())

    def update(self, **fields: Any) -> None:
        """Publishes changes of our own record without waiting (order is kept by Membership).

        `extra` fields are merged with the ones set before, so that one caller's digest does not
        erase another's join round."""
        if "extra" in fields:
            self.extra = {**self.extra, **fields["extra"]}
            fields["extra"] = dict(self.extra)
        task = asyncio.get_running_loop().create_task(self.membership.update(**fields))
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)
