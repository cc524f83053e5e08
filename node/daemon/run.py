"""Training and exchanging: the training thread runs the rounds, the event loop watches over it.

Every NodeTimeouts.watch_every_s the loop looks at what can end the run early: our p2pd gone
(nobody can reach us: training on alone would look healthy and help no one), members refusing us
as not admitted, a stop request (signal or preemption notice); and at what needs a hand now and
then: peers on another manifest to explain, a node alone to redial, the transport's refusals for
the status view. It serves our outer state to late joiners meanwhile (`serve_state`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from node.daemon.admission import ManifestWatch, refused_admission
from node.daemon.members import Reconnector
from node.daemon.worker import TrainingWorker
from node.events import Failed
from node.rounds.policy import RoundPolicy
from node.daemon.state_serving import StateServer
from node.train.trainer import InnerTrainer

if TYPE_CHECKING:
    from node.daemon.daemon import Daemon


def serve_state(node: Daemon, policy: RoundPolicy) -> StateServer:
    """Answers late joiners' (and diverged DiLoCoX members') requests for our outer state, from
    one shared export a round (node/daemon/state_serving.py)."""
    server = StateServer(policy, lambda: node.worker.round_index if node.worker else None)
    transport = node.network.transport  # its refusals (no round yet) count like any other
    server.register(transport, transport.counters.counted_reply(server.respond))
    return server


def round_end_beside(choice: str, protocol: str, device_type: str) -> bool:
    """`join --round-end`: DiLoCoX's round end in a thread beside training where the host's cores
    are free while the accelerator trains ("auto": on CUDA); on a CPU that thread would take the
    cores training needs (benchmarks/NOTEBOOK.md, "The CUDA path on one H100")."""
    if choice == "auto":
        return protocol == "dilocox" and device_type == "cuda"
    return choice == "beside"


async def train(node: Daemon, trainer: InnerTrainer, policy: RoundPolicy, corpus_digest: str) -> int:
    """Runs the training thread to the schedule's end or a stop; the exit code."""
    m, settings, timeouts = node.manifest, node.settings, node.settings.timeouts
    network = node.network
    total = m.train.steps
    if settings.max_steps:
        total = min(total, trainer.step + settings.max_steps)
    node.worker = worker = TrainingWorker(
        m.train, m.protocol.inner_steps, trainer, policy, total_steps=total,
        publish=lambda event: node.bridge.post(node.events.publish, event),
        save_checkpoint=lambda: node.checkpoint(trainer, policy, corpus_digest),
        peers_alive=lambda: len(network.cache.peers()),
        round_end_beside=round_end_beside(settings.round_end, m.protocol.name, trainer.device.type))
    worker.start()
    finished = asyncio.ensure_future(node.loop.run_in_executor(None, worker.finished.wait))
    stopping = asyncio.ensure_future(node.stop_event.wait())
    watch = ManifestWatch(network.host.dht, m)
    reconnector = Reconnector(network.host, network.cache, timeouts)
    transport = network.transport
    while not finished.done():
        await asyncio.wait({finished, stopping}, timeout=timeouts.watch_every_s,
                           return_when=asyncio.FIRST_COMPLETED)
        lost = network.host.p2pd_lost()
        if lost is not None and not node.stop_event.is_set():
            node.events.publish(Failed(error=f"the p2p daemon (p2pd) exited under this node "
                                       f"({lost}); stopping with a checkpoint: restart the node "
                                       f"to rejoin"))
            node.stop_event.set()
            continue
        if transport.counters.refused_outgoing.get("NOT_ADMITTED") and not node.stop_event.is_set():
            # Only a node that skipped its own check gets here (check_admission).
            node.events.publish(Failed(error=refused_admission(
                m.swarm.id, transport.identity.peer_id.to_base58(), "a member")))
            node.not_admitted = True
            node.stop_event.set()
            continue
        await watch.check(network.cache.peers())
        reconnector.check()
        node.status_feed.transport_refusals({**transport.counters.refused_incoming,
                                             **network.cache.bans.other_refusals})
        paths = transport.counters.paths
        node.status_feed.transport_paths(paths.direct, paths.relayed, paths.forwarded,
                                         transport.counters.forwarded_streams)
        if stopping.done() and not worker.stop_requested.is_set():
            worker.request_stop()
            try:
                await asyncio.wait_for(asyncio.shield(finished),
                                       settings.grace_s - timeouts.leave_reserve_s)
            except asyncio.TimeoutError:
                node.events.publish(Failed(error="the training thread did not stop within the "
                                           "grace period; exiting without a final checkpoint"))
                return 1
    stopping.cancel()
    await reconnector.stop()
    if worker.error is not None or node.not_admitted or network.host.p2pd_lost():
        return 1
    return 0
