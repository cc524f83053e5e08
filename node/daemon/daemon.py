"""`lowcomm-node join`: the daemon (ARCHITECTURE.md "Processes and threads in one daemon").

Main thread: an event loop (uvloop) owning p2pd, the DHT node, the signed streams, membership
and the protocol's exchange. Training thread: node/daemon/worker.py. The life of a node, in order:
join (identity, admission, p2p, membership, resume or late join), train and exchange (until
the schedule ends or a signal), leave (finish the step, checkpoint, tombstone, stop p2pd).

Invariants:
- the event loop never runs torch work longer than a copy (state exports go to a thread);
- SIGINT/SIGTERM lead to a checkpoint and exit 0 within `grace_s`; a second signal exits at once;
- every event of the node is one JSON line in <data_dir>/metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from node.train.checkpoint import CheckpointStore
from node.rounds.contributions import BanList
from node.data.corpus import load_corpus, stream_seed
from node.daemon.join import (STATE_KIND, ManifestWatch, check_admission, download_state,
                       publish_manifest, refused_admission, swarm_round, wait_for_members)
from node.ops.local_swarm import ADDRESS_FILE
from node.config.manifest import Manifest
from node.daemon.members import MemberCache, Reconnector
from node.train.standalone import MetricsLog
from node.train.trainer import InnerTrainer, pick_device
from node.rounds.wire_tensors import to_wire
from node.daemon.worker import TrainingWorker
from p2p.errors import Reason, Refusal
from p2p.host import P2PHost
from p2p.identity import NodeIdentity, identity_path
from p2p.membership import Membership
from p2p.messages import OutgoingMessage
from p2p.streams import Transport

log = logging.getLogger("lowcomm.daemon")
CHECKPOINT_FORMAT = 2


@dataclass
class NodeSettings:
    """How this machine runs its node: never part of the swarm's manifest."""

    data_dir: Path
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)  # what peers dial, when not `listen`
    peers: list[str] = field(default_factory=list)
    grace_s: float = 25.0
    max_steps: int = 0            # stop after this many inner steps (0: the schedule's end)
    member_ttl_s: float = 15.0
    port_mapping: bool = False
    seed: int = 0                 # for this node's choices (partners, groups), not its data
    ops: dict = field(default_factory=dict)  # node.ops.NodeOps options: mqtt, preemption, display
    min_peers: int = 0            # a fresh swarm: wait for this many other members before round 0
    min_peers_timeout_s: float = 120.0


class Daemon:
    def __init__(self, manifest: Manifest, settings: NodeSettings):
        self.manifest, self.settings = manifest, settings
        self.data_dir = Path(settings.data_dir)
        self.store = CheckpointStore(self.data_dir / "checkpoints")
        self.stop_event = asyncio.Event()
        self.metrics: MetricsLog | None = None
        self.worker: TrainingWorker | None = None
        self.cache: MemberCache | None = None
        self.not_admitted = False  # a member refused us NOT_ADMITTED: we stop with exit 1
        self.node_status = None
        self.transport = None
        self.host = None
        self._bytes_mark = (0, 0)
        self._started = time.monotonic()
        self._first_round = 0
        self.param_bytes = 0
        self._refused_seen: dict[str, int] = {}

    # ------------------------------------------------------------------ events
    def event(self, kind: str, **fields) -> None:
        """Called on the loop; the training thread goes through `_event_from_thread`."""
        record = {"event": kind, "time": time.time(), **fields}
        if self.node_status is not None:
            self._feed_status(kind, fields)
        if kind in ("round", "pair_correction") and self.cache is not None:
            # What late joiners and the DiLoCoX consensus check read: the digest of our φ, and
            # the one before it, so that a member a round ahead still reads our vote.
            previous = self.cache.extra
            self.cache.update(extra={"phi": fields["phi_digest"], "phi_round": fields["round"],
                                     "phi_prev": previous.get("phi", ""),
                                     "phi_prev_round": previous.get("phi_round", -1)})
        if self.metrics:
            self.metrics(record)
        if kind in ("round", "joined", "late_join", "diverged", "resync_ready", "no_partner",
                    "swap_failed", "stopping", "left", "failed", "resumed"):
            log.info("%s %s", kind, {k: v for k, v in fields.items() if k != "energy_kept"})

    def _feed_status(self, kind: str, fields: dict) -> None:
        """Keeps the operator's NodeStatus (status view, control socket, MQTT) current."""
        status = self.node_status
        if kind == "step":
            status.update(step=fields["step"], round=fields["round"], state="training",
                          tokens_per_second=fields["tokens_per_second"])
            status.record_train_loss(fields["loss"])
        elif kind == "round":
            if "val_loss" in fields:
                status.record_val_loss(fields["val_loss"])
            counters = self.transport.counters if self.transport else None
            sent = counters.bytes_sent - self._bytes_mark[0] if counters else 0
            received = counters.bytes_received - self._bytes_mark[1] if counters else 0
            if counters:
                self._bytes_mark = (counters.bytes_sent, counters.bytes_received)
            partners = [fields["partner"]] if fields.get("partner") else list(fields.get("group", []))
            exchanged = bool(partners)
            status.record_round(sent=sent, received=received, exchanged=exchanged)
            elapsed = time.monotonic() - self._started
            status.update(partners=partners, peers_alive=fields.get("peers_alive", 0),
                          peers_known=len(self.cache.records) if self.cache else 0,
                          rounds_per_minute=(fields["round"] + 1 - self._first_round) * 60 / elapsed)
            refused = fields.get("refused") or []
            if isinstance(refused, str):  # NoLoCo: one sentence; DiLoCoX: a list of them
                refused = [refused]
            if refused:
                status.count_refused("contribution", len(refused))
        elif kind in ("swapped", "sent") and fields.get("bytes"):
            # fp32 size over wire size of one payload: NoLoCo's (φ, Δ), DiLoCoX's coded Δ (per
            # payload, since a swap may finish after its round's bytes were counted)
            copies = 2 if kind == "swapped" else 1
            status.update(compression_ratio=copies * self.param_bytes / fields["bytes"])
        elif kind == "checkpoint":
            status.update(checkpoint_at=time.time(), checkpoint_step=fields["step"])
        elif kind == "stopping":
            status.update(state="stopping")

    def _event_from_thread(self, record: dict) -> None:
        record = dict(record)
        kind = record.pop("event")
        if kind == "round":
            record["peers_alive"] = len(self.cache.peers()) if self.cache else 0
        self.loop.call_soon_threadsafe(lambda: self.event(kind, **record))

    # ------------------------------------------------------------------ life
    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._on_signal, sig)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.data_dir / "metrics.jsonl")
        identity = NodeIdentity.load_or_create(identity_path(self.data_dir))
        peer_id = identity.peer_id.to_base58()
        check_admission(self.manifest, peer_id)
        m, train = self.manifest, self.manifest.train
        if train.threads:
            torch.set_num_threads(train.threads)
        corpus = load_corpus(m.data)
        trainer = InnerTrainer(m.model, train, corpus, m.data.seq_len,
                               stream_seed(identity.public_key_bytes, train.seed),
                               pick_device(train.device))
        self.param_bytes = 4 * sum(p.numel() for p in trainer.model.parameters())
        from node.ops.services import NodeOps
        from node.ops.status import NodeStatus
        self.node_status = NodeStatus(peer_id=peer_id, swarm=m.swarm.id, protocol=m.protocol.name,
                                      device=str(trainer.device))
        ops = NodeOps(self.node_status, self.data_dir, on_preemption=self._on_preemption,
                      **self.settings.ops)
        await ops.start()
        try:
            return await self._run_networked(identity, peer_id, trainer, corpus)
        finally:
            await ops.stop()

    def _on_preemption(self, reason: str) -> None:
        self.event("stopping", signal=f"preemption notice ({reason})")
        self.stop_event.set()

    async def _run_networked(self, identity, peer_id, trainer, corpus) -> int:
        m = self.manifest
        host = await P2PHost.start(identity, host_maddrs=self.settings.listen,
                                   announce_maddrs=self.settings.announce or None,
                                   initial_peers=[*self.settings.peers, *m.network.bootstrap_peers],
                                   nat_port_map=self.settings.port_mapping)
        transport = membership = cache = exchange = None
        try:
            transport = self.transport = Transport(host.p2p, identity, swarm=m.swarm.id,
                                                   manifest=m.digest)
            admit = None
            if m.admission.mode == "allowlist":  # members refuse, and never call, unlisted keys
                admit = set(m.admission.public_keys).__contains__
                transport.admit = admit
            await transport.start()
            membership = Membership(host, m.swarm.id, protocol=m.protocol.name,
                                    manifest=m.digest, ttl_s=self.settings.member_ttl_s)
            await membership.start()
            cache = self.cache = MemberCache(membership, admit=admit)
            await cache.start()
            await publish_manifest(host.dht, m)
            addresses = await host.maddrs()
            (self.data_dir / ADDRESS_FILE).write_text("\n".join(addresses) + "\n")
            self.event("joined", peer_id=peer_id, addresses=addresses, manifest=m.digest,
                       corpus_digest=corpus.digest)
            bans = BanList(m.contributions.ban_after, m.contributions.ban_seconds)
            transport.counters.on_refusal_issued = \
                lambda peer, reason: bans.transport_refusal(peer, reason.name, transport.ban)

            def forged_record(peer: str) -> None:  # a flooder sends many: strike until banned
                if not bans.is_banned(peer):
                    bans.refuse(peer, "FORGED_RECORD", f"refused a member record that {peer} stored "
                                "in our DHT: it is not signed by the member it names (a forgery)",
                                transport.ban)
            host.validator.on_forgery = forged_record
            policy, exchange = self._protocol(trainer, transport, cache, peer_id, bans)
            start_round = await self._resume_or_join(trainer, policy, transport, cache)
            transport.on_request(STATE_KIND, lambda header: self._serve_state(policy, header),
                                 accept_round=lambda _r: True)
            self._first_round = start_round
            exchange.start(start_round)
            cache.update(round=start_round, status="training", extra={"since": start_round})
            self.event("started", round=start_round, step=trainer.step)
            watch = ManifestWatch(host.dht, m)
            self.host = host
            code = await self._train(trainer, policy, corpus.digest, cache, watch, transport)
        finally:
            await self._leave(host, transport, membership, cache, exchange)
        return code

    def _protocol(self, trainer, transport, cache, peer_id: str, bans: BanList):
        m, p = self.manifest, self.manifest.protocol
        rng = random.Random(f"{self.settings.seed}:{peer_id}")
        report = lambda kind, fields: self.event(kind, **fields)
        if p.name == "noloco":
            from node.rounds.noloco.exchange import NoLoCoExchange
            from node.rounds.noloco.round import NoLoCoRound
            from protocol.noloco import NoLoCoHyperParameters
            exchange = NoLoCoExchange(self.loop, transport, cache, peer_id, m.digest, p.timing,
                                      p.max_staleness, bans, m.contributions.ban_seconds,
                                      p.pair_deadline_s, rng, report)
            hyper = NoLoCoHyperParameters(p.momentum, p.progress_weight, p.consensus_weight)
            policy = NoLoCoRound(trainer, hyper, exchange, p.inner_steps, p.wire_dtype, p.timing,
                                 p.pair_deadline_s, m.contributions.max_norm_ratio,
                                 m.contributions.min_alignment_sigmas)
            return policy, exchange
        from node.rounds.dilocox.exchange import DiLoCoXExchange
        from node.rounds.dilocox.round import DiLoCoXRound
        from protocol.codecs import get_codec
        from protocol.diloco import DiLoCoHyperParameters
        from protocol.dilocox import DiLoCoXHyperParameters
        codec_params = {"lowrank": {"rank": p.rank, "bits": p.bits},
                        "blockwise": {"bits": p.bits}}.get(p.codec, {})
        exchange = DiLoCoXExchange(self.loop, transport, cache, peer_id, m.digest, p.fan_out,
                                   p.message_deadline_s, bans, m.contributions.ban_seconds, rng,
                                   report)
        # Nesterov needs momentum; μ = 0 is plain SGD on the mean pseudo-gradient.
        outer = DiLoCoHyperParameters(p.outer_lr, p.outer_momentum, nesterov=p.outer_momentum > 0)
        hyper = DiLoCoXHyperParameters(outer,
                                       p.delay)
        policy = DiLoCoXRound(trainer, hyper, get_codec(p.codec, **codec_params), peer_id,
                              exchange, m.contributions.max_norm_ratio, p.message_deadline_s)
        return policy, exchange

    async def _resume_or_join(self, trainer, policy, transport, cache) -> int:
        """The round to start at: from our checkpoint, from the swarm's state, or 0."""
        H = self.manifest.protocol.inner_steps
        self.store.remove_stale_temporaries()
        loaded = self.store.load_latest()
        if loaded is not None:
            for reason in loaded.skipped:
                self.event("checkpoint_skipped", reason=reason)
            state = loaded.state
            if state.get("format") != CHECKPOINT_FORMAT or state.get("manifest") != self.manifest.digest:
                raise RuntimeError(f"checkpoint {loaded.path.name} belongs to another swarm "
                                   f"manifest: use a fresh --data-dir or the same manifest")
            trainer.load_state_dict(state["trainer"])
            policy.load_state_dict(state["policy"])
            self.event("resumed", checkpoint=loaded.path.name, step=trainer.step)
            await wait_for_members(cache, timeout_s=2.0)
            lag = swarm_round(cache.peers(), self.manifest.digest) - trainer.step // H
            # Too far behind to pair (NoLoCo) or to share φ (DiLoCoX): catch up like a late
            # joiner, keeping our own inner optimizer and data position.
            if lag <= max(1, self.manifest.protocol.max_staleness):
                return trainer.step // H
        else:
            await wait_for_members(cache, timeout_s=2.0)
            if swarm_round(cache.peers(), self.manifest.digest) == 0:
                await self._wait_min_peers(cache)
                return 0
        joined = await download_state(transport, cache, self.manifest)
        if joined is None:
            return trainer.step // H
        await self.loop.run_in_executor(None, policy.adopt, joined.tensors)
        start = joined.round_index
        trainer.start_at(start * H)
        self.event("late_join", source=joined.source, round=start,
                   state_round=joined.meta.get("phi_round"), digest=joined.meta.get("phi"))
        return start

    async def _wait_min_peers(self, cache) -> None:
        """A swarm that starts together trains together: wait (bounded) for the others."""
        wanted, deadline = self.settings.min_peers, self.loop.time() + self.settings.min_peers_timeout_s
        same = lambda: [r for r in cache.peers() if r.manifest == self.manifest.digest]
        while len(same()) < wanted and self.loop.time() < deadline and not self.stop_event.is_set():
            cache.refreshed.clear()
            try:
                await asyncio.wait_for(cache.refreshed.wait(), timeout=deadline - self.loop.time())
            except asyncio.TimeoutError:
                break
        if len(same()) < wanted:
            self.event("min_peers_timeout", wanted=wanted, found=len(same()))

    async def _serve_state(self, policy, header) -> OutgoingMessage:
        wanted = header.meta.get("phi_round")
        state_round, groups, digest = await self.loop.run_in_executor(
            None, policy.export_state, wanted if isinstance(wanted, int) else None)
        if state_round < 0:
            raise Refusal(Reason.REFUSED, "no completed round yet")
        tensors = await self.loop.run_in_executor(
            None, lambda: to_wire(groups["phi"], "fp32", "phi/")
            + to_wire(groups["momentum"], "fp32", "momentum/"))
        round_now = self.worker.round_index if self.worker else state_round + 1
        return OutgoingMessage(STATE_KIND, 0, tensors,
                               {"round": round_now, "phi_round": state_round, "phi": digest})

    def _checkpoint(self, trainer, policy, corpus_digest: str) -> None:
        """Runs in the training thread, between steps."""
        self.store.save({"format": CHECKPOINT_FORMAT, "manifest": self.manifest.digest,
                         "corpus_digest": corpus_digest, "trainer": trainer.state_dict(),
                         "policy": policy.state_dict()}, trainer.step)
        self._event_from_thread({"event": "checkpoint", "step": trainer.step})

    async def _train(self, trainer, policy, corpus_digest, cache, watch, transport) -> int:
        H = self.manifest.protocol.inner_steps
        total = self.manifest.train.steps
        if self.settings.max_steps:
            total = min(total, trainer.step + self.settings.max_steps)
        # In rounds; 0 keeps the config's meaning: never during training (a checkpoint is still
        # written when the node stops).
        every = lambda steps: max(1, steps // H) if steps else 0
        eval_rounds = every(self.manifest.train.eval_every)
        ckpt_rounds = every(self.manifest.train.checkpoint_every)
        self.worker = TrainingWorker(trainer, policy, H, total, self._event_from_thread,
                                     lambda: self._checkpoint(trainer, policy, corpus_digest),
                                     eval_rounds, ckpt_rounds, self.manifest.train.min_step_seconds)
        self.worker.start()
        finished = asyncio.ensure_future(self.loop.run_in_executor(None, self.worker.finished.wait))
        reconnector = Reconnector(self.host, cache)
        stopping = asyncio.ensure_future(self.stop_event.wait())
        while not finished.done():
            await asyncio.wait({finished, stopping}, timeout=2.0,
                               return_when=asyncio.FIRST_COMPLETED)
            lost = self.host.p2pd_lost() if self.host is not None else None
            if lost is not None and not self.stop_event.is_set():
                # Nobody can reach this node any more, and it can reach nobody: training on
                # alone would look healthy and help no one. Checkpoint and say so.
                self.event("failed", error=f"the p2p daemon (p2pd) exited under this node "
                           f"({lost}); stopping with a checkpoint: restart the node to rejoin")
                self.stop_event.set()
                continue
            if transport.counters.refused_outgoing.get("NOT_ADMITTED") and not self.stop_event.is_set():
                # Only a node that skipped its own check gets here (check_admission).
                self.event("failed", error=refused_admission(
                    self.manifest.swarm.id, transport.identity.peer_id.to_base58(), "a member"))
                self.not_admitted = True
                self.stop_event.set()
                continue
            await watch.check(cache.peers())
            reconnector.check()
            refused = dict(transport.counters.refused_incoming)
            if refused != self._refused_seen:  # transport refusals by reason, beside ours
                self.node_status.update(refused={**self.node_status.refused, **refused})
                self._refused_seen = refused
            if stopping.done() and not self.worker.stop_requested.is_set():
                self.worker.request_stop()
                try:
                    await asyncio.wait_for(asyncio.shield(finished), self.settings.grace_s - 5)
                except asyncio.TimeoutError:
                    self.event("failed", error="the training thread did not stop within the grace "
                               "period; exiting without a final checkpoint")
                    return 1
        stopping.cancel()
        await reconnector.stop()
        if self.worker.error is not None or self.not_admitted or \
                (self.host is not None and self.host.p2pd_lost()):
            return 1
        return 0

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop_event.is_set():
            raise SystemExit(130)  # a second signal: the user insists
        self.event("stopping", signal=signal.Signals(sig).name)
        self.stop_event.set()

    async def _leave(self, host, transport, membership, cache, exchange) -> None:
        """Tombstone in the DHT, stop serving, stop p2pd; each step bounded."""
        steps = [(exchange.stop() if exchange else None), (cache.stop() if cache else None),
                 (membership.leave() if membership else None),
                 (transport.stop() if transport else None), host.shutdown()]
        for step in steps:
            if step is not None:
                try:
                    await asyncio.wait_for(step, timeout=5.0)
                except Exception as exc:  # leaving must go on: each step is best effort
                    log.warning("while leaving: %s", exc)
        (self.data_dir / ADDRESS_FILE).unlink(missing_ok=True)
        if transport is not None:  # the proof that every message was signed and verified
            self.event("transport", **transport.counters.snapshot())
        self.event("left")
        if self.metrics:
            self.metrics.close()
