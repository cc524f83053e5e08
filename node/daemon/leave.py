"""Leaving a swarm: stop exchanging, tombstone our record in the DHT, let the messages on their
way to peers arrive, stop serving, stop p2pd.

Each step is bounded (NodeTimeouts.leave_step_s) and best effort: a step that fails or hangs is
logged and the next one runs, so a node always leaves within its grace period. What was started
in the background is cancelled last; the transport's counters are reported, the proof that
every message was signed and verified.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from node.events import Left, TransportSummary

if TYPE_CHECKING:
    from node.daemon.daemon import Daemon

log = logging.getLogger("lowcomm.daemon")


async def leave(node: Daemon) -> None:
    network, step_s = node.network, node.settings.timeouts.leave_step_s
    steps = [network.exchange.stop() if network.exchange else None,
             network.cache.stop(step_s) if network.cache else None,
             network.membership.leave() if network.membership else None,
             # a swap or send cut by p2pd's end reaches its peer TRUNCATED (seen in CI)
             node.tasks.finish_transfers(step_s / 2),
             network.transport.stop(grace_s=step_s / 2) if network.transport else None,
             network.host.shutdown() if network.host else None]
    for step in steps:
        if step is not None:
            try:
                await asyncio.wait_for(step, timeout=step_s)
            except Exception as exc:  # leaving must go on: each step is best effort
                log.warning("while leaving: %s", exc)
    await node.tasks.stop(step_s)
    node.data_dir.address.unlink(missing_ok=True)
    if network.transport is not None:
        node.events.publish(TransportSummary(counters=network.transport.counters.snapshot()))
    node.events.publish(Left())
