"""`lowcomm-node join`: the daemon (docs/architecture.md "Processes and threads in one daemon").

Main thread: an event loop (uvloop) owning p2pd, the DHT node, the signed streams, membership
and the protocol's exchange. Training thread: node/daemon/worker.py. The life of a node, one
module per phase:

    join   node/daemon/join.py   identity and admission, p2p, membership, resume or late join
    run    node/daemon/run.py    train and exchange until the schedule ends or a stop
    leave  node/daemon/leave.py  finish the step, checkpoint, tombstone, stop p2pd

The Daemon builds the parts and wires the node's events (node/events.py) to their subscribers:
the metrics log, the log, the status feed (node/ops/status_feed.py) and the φ announcement
(node/daemon/members.py). It computes nothing from them.

Invariants:
- the event loop never runs torch work longer than a copy (state exports and decoding go to a
  thread);
- SIGINT/SIGTERM lead to a checkpoint and exit 0 within `grace_s`; a second signal exits at once;
  a stop that comes while the node is still joining (resuming, or downloading the swarm's state)
  ends the join there and exits 0 without training: what it has trained is already in its
  checkpoint, and a state half taken is never used (its servers may be the peers leaving with it);
- every event of the node is one JSON line in <data_dir>/metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal

import torch

from node.config.manifest import Manifest, ProtocolSection
from node.config.settings import NodeSettings
from node.daemon.admission import check_admission
from node.daemon.join import CHECKPOINT_FORMAT, Network, connect, resume_or_join
from node.daemon.leave import leave
from node.daemon.members import PhiAnnouncer
from node.daemon.run import serve_state, train
from node.rounds.state import StateLayout
from p2p.probe import serve_probe
from node.daemon.worker import TrainingWorker
from node.data.corpus import load_corpus, stream_seed
from node.data_dir import DataDir, MetricsLog
from node.events import (Checkpointed, EventBus, Joined, PairCorrected, RoundEnded, Started,
                         Stopping, log_event)
from node.loop import BackgroundTasks, LoopBridge
from node.ops.status_feed import StatusFeed
from node.rounds.message_sizes import round_message_bytes, transport_limits
from node.rounds.policy import RoundPolicy
from node.rounds.swarm import Swarm
from node.train.checkpoint import CheckpointStore
from node.train.trainer import InnerTrainer, pick_device
from p2p.identity import NodeIdentity

log = logging.getLogger("lowcomm.daemon")


class Daemon:
    def __init__(self, manifest: Manifest, settings: NodeSettings):
        self.manifest, self.settings = manifest, settings
        self.data_dir = DataDir(settings.data_dir)
        self.store = CheckpointStore(self.data_dir.checkpoints)
        self.events = EventBus()
        self.tasks = BackgroundTasks(self.events.publish)
        self.network = Network()
        self.stop_event = asyncio.Event()
        self.worker: TrainingWorker | None = None
        self.status_feed: StatusFeed | None = None
        self.not_admitted = False  # a member refused us NOT_ADMITTED: we stop with exit 1
        # (WireLimits, TransferLimits) from the manifest's messages (node/rounds/message_sizes.py),
        # set by `run` before anything starts; None: the transport's defaults (a benchmark that
        # drives join.connect with payloads of its own, benchmarks/sync_time.py)
        self.transport_limits = None
        self.vocab_size = 256  # the corpus's, once loaded
        self.round_message_bytes: int | None = None  # a round message's bound, once known

    def bind_loop(self) -> None:
        """Takes the running event loop, and the bridge the training thread calls it through.
        `run` does it first; a benchmark that drives join.connect and leave.leave itself
        (benchmarks/sync_time.py) does it instead."""
        self.loop = asyncio.get_running_loop()
        self.bridge = LoopBridge(self.loop, self.tasks, self.settings.timeouts.loop_call_s)

    async def run(self) -> int:
        self.bind_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._on_signal, sig)
        self.data_dir.root.mkdir(parents=True, exist_ok=True)
        metrics = MetricsLog(self.data_dir.metrics)
        self.events.subscribe(metrics)
        self.events.subscribe(log_event)
        try:
            identity = NodeIdentity.load_or_create(self.data_dir.identity)
            check_admission(self.manifest, identity.peer_id.to_base58())
            m, train_config = self.manifest, self.manifest.train
            if train_config.threads:
                torch.set_num_threads(train_config.threads)
            corpus = load_corpus(m.data)
            # a swarm whose messages cannot fit the transport stops here, in one sentence
            self.transport_limits = transport_limits(m, corpus.vocab_size, transfer=self.settings.transfer)
            self.vocab_size = corpus.vocab_size
            self.round_message_bytes = round_message_bytes(m, corpus.vocab_size)
            trainer = InnerTrainer(m.model, train_config, corpus, m.data.seq_len,
                                   stream_seed(identity.public_key_bytes, train_config.seed),
                                   pick_device(train_config.device))
            from node.ops.services import NodeOps
            from node.ops.status import NodeStatus
            from node.rounds.noloco.payload import tensor_sets
            status = NodeStatus(peer_id=identity.peer_id.to_base58(), swarm=m.swarm.id,
                                protocol=m.protocol.name, device=str(trainer.device))
            self.status_feed = StatusFeed(
                status, param_bytes=4 * sum(p.numel() for p in trainer.model.parameters()),
                snapshot_sets=tensor_sets(m.protocol.snapshot),
                traffic=self._traffic,
                peers_known=lambda: len(self.network.cache.records) if self.network.cache else 0)
            self.status_feed.subscribe(self.events)
            ops = NodeOps(status, self.data_dir.root, on_preemption=self._on_preemption,
                          **self.settings.ops)
            await ops.start()
            try:
                return await self._run_networked(identity, trainer, corpus.digest)
            finally:
                await ops.stop()
        finally:
            metrics.close()

    async def _run_networked(self, identity: NodeIdentity, trainer: InnerTrainer,
                             corpus_digest: str) -> int:
        try:
            swarm = await connect(self, identity)
            addresses = await self.network.host.maddrs()
            self.data_dir.address.write_text("\n".join(addresses) + "\n")
            self.events.publish(Joined(peer_id=swarm.peer_id, addresses=addresses,
                                       manifest=self.manifest.digest, corpus_digest=corpus_digest))
            self.events.subscribe(PhiAnnouncer(swarm.members), RoundEnded, PairCorrected)
            policy = self._protocol(trainer, swarm)
            swarm.state_layout = await self.loop.run_in_executor(
                None, lambda: StateLayout.of(policy.export_state()[1]["phi"]))
            start_round = await self._unless_stopped(resume_or_join(self, trainer, policy))
            if start_round is None:
                log.info("stopped while joining: leaving before training (nothing new to checkpoint)")
                return 0
            serve_state(self, policy)
            serve_probe(self.network.transport)  # `doctor`s time their links against us
            self.network.exchange.start(start_round)
            swarm.members.update(round=start_round, status="training", extra={"since": start_round})
            self.events.publish(Started(round=start_round, step=trainer.step))
            return await train(self, trainer, policy, corpus_digest)
        finally:
            await leave(self)

    async def _unless_stopped(self, work):
        """`work`'s result, or None when a stop (signal, preemption notice) comes first: then
        `work` is cancelled, and an error it ends with meanwhile is the stop's, not the node's."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self.stop_event.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not task.done():  # stopped, or this wait itself was cancelled
                task.cancel()
            await asyncio.gather(task, stopping, return_exceptions=True)
        if self.stop_event.is_set() and (task.cancelled() or task.exception() is not None):
            if not task.cancelled():
                log.info("after the stop, the join ended with %s: %s", type(task.exception()).__name__,
                         task.exception())
            return None
        return task.result()

    def _protocol(self, trainer: InnerTrainer, swarm: Swarm) -> RoundPolicy:
        """The manifest's protocol: its round (training thread) and exchange (event loop)."""
        m = self.manifest
        self.network.exchange = exchange = build_exchange(m.protocol, swarm, self.settings.seed)
        if m.protocol.name == "noloco":
            from node.rounds.noloco.round import NoLoCoRound, rounding_seed
            return NoLoCoRound(m.protocol, m.contributions, trainer, exchange,
                               rounding_seed(self.settings.seed, swarm.peer_id))
        from node.rounds.dilocox.round import DiLoCoXRound
        return DiLoCoXRound(m.protocol, m.contributions, trainer, swarm.peer_id, exchange)

    def checkpoint(self, trainer: InnerTrainer, policy: RoundPolicy, corpus_digest: str) -> None:
        """Runs in the training thread, between steps."""
        path = self.store.save({"format": CHECKPOINT_FORMAT, "manifest": self.manifest.digest,
                                "corpus_digest": corpus_digest, "trainer": trainer.state_dict(),
                                "policy": policy.state_dict()}, trainer.step)
        self.bridge.post(self.events.publish, Checkpointed(step=trainer.step, path=path.name))

    def _traffic(self) -> tuple[int, int]:
        counters = self.network.transport.counters if self.network.transport else None
        return (counters.bytes_sent, counters.bytes_received) if counters else (0, 0)

    def _on_preemption(self, reason: str) -> None:
        self.events.publish(Stopping(signal=f"preemption notice ({reason})"))
        self.stop_event.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop_event.is_set():
            raise SystemExit(130)  # a second signal: the user insists
        self.events.publish(Stopping(signal=signal.Signals(sig).name))
        self.stop_event.set()


def build_exchange(config: ProtocolSection, swarm: Swarm, seed: int):
    """The exchange of the manifest's protocol (NoLoCoExchange or DiLoCoXExchange), drawing this
    node's choices (partners, groups) from `seed` and its peer id: the daemon's, and the one
    benchmarks/sync_time.py times."""
    rng = random.Random(f"{seed}:{swarm.peer_id}")
    if config.name == "noloco":
        from node.rounds.noloco.exchange import NoLoCoExchange
        return NoLoCoExchange(config, swarm, rng)
    from node.rounds.dilocox.exchange import DiLoCoXExchange
    return DiLoCoXExchange(config, swarm, rng)
