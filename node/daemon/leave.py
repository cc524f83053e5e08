"""Leaving a swarm: stop exchanging, tombstone our record in the DHT, let the messages on their
way to peers arrive, stop serving, stop p2pd.

Each step is bounded (NodeTimeouts.leave_step_s) and best effort: a step that fails or hangs is
logged and the next one runs, so a node always leaves within its grace period. The messages on
their way get half a step when a stop was asked (a signal, a preemption notice: the grace
period is short), and up to `leave_drain_s` when the node ended its schedule: nobody waits on
that exit, and a peer on a slow link may still be receiving the last round's message (the
512 kbit/s runs, benchmarks/NOTEBOOK.md, "A diverged DiLoCoX node replays its steps": a node cut
its push 2.5 s after its last round, at 260 of 411 KB, and that member waited 16 s for it and then
left it out of its step). What was started in the background is cancelled last; the transport's
counters are reported, the proof that every message was signed and verified.
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
    network, timeouts = node.network, node.settings.timeouts
    step_s = timeouts.leave_step_s
    drain_s = step_s / 2 if node.stop_event.is_set() else max(step_s / 2, timeouts.leave_drain_s)
    steps = [(network.exchange.stop() if network.exchange else None, step_s),
             (network.cache.stop(step_s) if network.cache else None, step_s),
             (network.membership.leave() if network.membership else None, step_s),
             # a swap or send cut by p2pd's end reaches its peer TRUNCATED (seen in CI)
             (node.tasks.finish_transfers(drain_s), drain_s + step_s),
             (network.transport.stop(grace_s=step_s / 2) if network.transport else None, step_s),
             (network.host.shutdown() if network.host else None, step_s)]
    for step, timeout_s in steps:
        if step is not None:
            try:
                await asyncio.wait_for(step, timeout=timeout_s)
            except Exception as exc:  # leaving must go on: each step is best effort
                log.warning("while leaving: %s", exc)
    await node.tasks.stop(step_s)
    node.data_dir.address.unlink(missing_ok=True)
    if network.transport is not None:
        node.events.publish(TransportSummary(counters=network.transport.counters.snapshot()))
    node.events.publish(Left())
