"""Joining a swarm: connecting to it, then resuming our own state or taking the swarm's.

- Connect: p2pd and the DHT, the signed transport (admission and bans wired into it), our member
  record and the member cache, our manifest published under its digest.
- Resume or join late: a node with a checkpoint resumes from it; a node with none, in a swarm
  already past round 0, downloads the outer state from a member over a signed stream, checks it
  against the digest that member announced (DiLoCoX: the digest a majority announced), and only
  then starts, at the swarm's round. Nothing is written until the state is complete and
  verified. A node resuming too far behind its swarm to pair (NoLoCo) or share φ (DiLoCoX)
  joins late the same way, keeping its inner optimizer and data position.
- A fresh swarm: the first node waits (bounded) for --min-peers others before round 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from node.config.manifest import Manifest
from node.config.settings import NodeTimeouts
from node.daemon.admission import AdmissionError, publish_manifest, refused_admission
from node.daemon.members import MemberCache
from node.events import CheckpointSkipped, LateJoined, MinPeersTimeout, ReachabilityFound, Resumed
from node.rounds.contributions import BanList
from node.rounds.policy import RoundPolicy
from node.rounds.state import STATE_KIND, announced_phi, decode_state
from node.rounds.swarm import Swarm
from node.train.trainer import InnerTrainer
from p2p.errors import P2PError, Reason, RemoteRefused
from p2p.host import P2PHost
from p2p.identity import NodeIdentity
from p2p.membership import Membership
from p2p.reachability import ReachabilityOptions
from p2p.streams import Transport
from protocol.dilocox import winning_digest

if TYPE_CHECKING:
    from node.daemon.daemon import Daemon

log = logging.getLogger("lowcomm.join")
CHECKPOINT_FORMAT = 2
ANNOUNCEMENT_POLL_S = 0.1  # a joiner looks up a member's announcement this often, while waiting


@dataclass
class Network:
    """The node's network parts, in the order they start; node/daemon/leave.py stops them."""

    host: P2PHost | None = None
    transport: Transport | None = None
    membership: Membership | None = None
    cache: MemberCache | None = None
    exchange: Any = None  # the protocol's exchange, once built


async def connect(node: Daemon, identity: NodeIdentity) -> Swarm:
    """Starts p2pd, the transport and membership in `node.network`; the Swarm the exchanges use."""
    m, settings, network = node.manifest, node.settings, node.network
    network.host = host = await P2PHost.start(
        identity, host_maddrs=settings.listen, announce_maddrs=settings.announce or None,
        initial_peers=[*settings.peers, *m.network.bootstrap_peers],
        nat_port_map=settings.port_mapping, startup_timeout_s=settings.timeouts.p2pd_start_s,
        reachability=ReachabilityOptions(settings.reachability, tuple(settings.relays)))
    node.events.publish(ReachabilityFound(**host.reachability.to_dict()))
    network.transport = transport = Transport(host.p2p, identity, swarm=m.swarm.id, manifest=m.digest)
    admit = None
    if m.admission.mode == "allowlist":  # members refuse, and never call, unlisted keys
        admit = transport.admit = set(m.admission.public_keys).__contains__
    await transport.start()
    network.membership = Membership(host, m.swarm.id, protocol=m.protocol.name, manifest=m.digest,
                                    ttl_s=settings.member_ttl_s)
    await network.membership.start()
    bans = BanList(m.contributions.ban_after, m.contributions.ban_seconds)
    network.cache = cache = MemberCache(network.membership, node.tasks, manifest=m.digest, bans=bans,
                                        refresh_s=settings.timeouts.member_refresh_s, admit=admit)
    await cache.start()
    await publish_manifest(host.dht, m)
    transport.counters.on_refusal_issued = \
        lambda peer, reason: bans.transport_refusal(peer, reason.name, transport.ban)

    def forged_record(peer: str) -> None:  # a flooder sends many: strike until banned
        if not bans.is_banned(peer):
            bans.refuse(peer, "FORGED_RECORD", f"refused a member record that {peer} stored in our "
                        "DHT: it is not signed by the member it names (a forgery)", transport.ban)
    host.validator.on_forgery = forged_record
    return Swarm(node.loop, transport, cache, bans, identity.peer_id.to_base58(), m.digest,
                 node.bridge, node.tasks, node.events.publish, settings.timeouts)


async def resume_or_join(node: Daemon, trainer: InnerTrainer, policy: RoundPolicy) -> int:
    """The round to start at: from our checkpoint, from the swarm's state, or 0."""
    H, cache, timeouts = node.manifest.protocol.inner_steps, node.network.cache, node.settings.timeouts
    node.store.remove_stale_temporaries()
    loaded = node.store.load_latest()
    if loaded is not None:
        for reason in loaded.skipped:
            node.events.publish(CheckpointSkipped(reason=reason))
        state = loaded.state
        if state.get("format") != CHECKPOINT_FORMAT or state.get("manifest") != node.manifest.digest:
            raise RuntimeError(f"checkpoint {loaded.path.name} belongs to another swarm "
                               f"manifest: use a fresh --data-dir or the same manifest")
        trainer.load_state_dict(state["trainer"])
        policy.load_state_dict(state["policy"])
        node.events.publish(Resumed(checkpoint=loaded.path.name, step=trainer.step))
        await wait_for_members(cache, timeouts.first_members_s)
        lag = swarm_round(cache.eligible()) - trainer.step // H
        # Too far behind to pair (NoLoCo) or to share φ (DiLoCoX): catch up like a late
        # joiner, keeping our own inner optimizer and data position.
        if lag <= max(1, node.manifest.protocol.max_staleness):
            return trainer.step // H
    else:
        await wait_for_members(cache, timeouts.first_members_s)
        if swarm_round(cache.eligible()) == 0:
            await wait_min_peers(node, cache)
            return 0
    joined = await download_state(node.network.transport, cache, node.manifest, timeouts)
    if joined is None:
        return trainer.step // H
    await node.loop.run_in_executor(None, policy.adopt, joined.tensors)
    start = joined.round_index
    trainer.start_at(start * H)
    node.events.publish(LateJoined(source=joined.source, round=start,
                                   state_round=joined.meta.get("phi_round"),
                                   digest=joined.meta.get("phi")))
    return start


async def wait_min_peers(node: Daemon, cache: MemberCache) -> None:
    """A swarm that starts together trains together: wait (bounded) for the others."""
    wanted = node.settings.min_peers
    deadline = node.loop.time() + node.settings.min_peers_timeout_s
    while len(cache.eligible()) < wanted and node.loop.time() < deadline \
            and not node.stop_event.is_set():
        cache.refreshed.clear()
        try:
            await asyncio.wait_for(cache.refreshed.wait(), timeout=deadline - node.loop.time())
        except asyncio.TimeoutError:
            break
    if len(cache.eligible()) < wanted:
        node.events.publish(MinPeersTimeout(wanted=wanted, found=len(cache.eligible())))


@dataclass
class JoinState:
    round_index: int
    tensors: dict[str, dict[str, torch.Tensor]]  # group -> name -> fp32 tensor
    meta: dict
    source: str


def swarm_round(members) -> int:
    """The highest round an eligible member has reached (0 for a new swarm)."""
    return max((r.round for r in members), default=0)


def expected_digests(members, source, protocol: str, state_round: Any) -> set[str]:
    """The digests a joiner may find in a downloaded φ of `state_round`.

    NoLoCo members each hold their own φ: trust the serving member's signed announcements of
    that round (its latest and the one before: a mid-round correction announces a second φ of
    the same round, and a fast member may have ended another round since it served us).
    DiLoCoX members share φ: trust what the eligible majority announced for that round.
    """
    if protocol == "noloco":
        extra = source.extra
        return {extra[digest] for digest, announced in (("phi", "phi_round"),
                                                        ("phi_prev", "phi_prev_round"))
                if extra.get(announced) == state_round and isinstance(extra.get(digest), str)}
    votes = Counter(vote for r in members if (vote := announced_phi(r.extra, state_round)))
    return {winning_digest(votes)} if votes else set()


async def download_state(transport, cache: MemberCache, manifest: Manifest,
                         timeouts: NodeTimeouts) -> JoinState | None:
    """The outer state of the most advanced member, verified; None when no member has one.

    The state is accepted only when its digest equals the digest announced (signed, in the DHT)
    for the same round; an announcement that lags the state is waited for, briefly.
    """
    candidates = sorted((r for r in cache.eligible() if r.round > 0 and r.extra.get("phi")),
                        key=lambda r: -r.round)
    errors, not_admitted = [], 0
    for source in candidates[:timeouts.state_download_attempts]:
        try:
            received = await transport.request(source.peer_id, STATE_KIND, 0,
                                               timeout=timeouts.state_download_s,
                                               streams=transport.limits.parallel_streams)
        except P2PError as exc:  # a member that failed mid-transfer: nothing of it is kept
            log.warning("the state from %s did not arrive (%s); asking the next member",
                        source.peer_id, exc)
            errors.append(f"{source.peer_id}: {exc}")
            not_admitted += isinstance(exc, RemoteRefused) and exc.reason == Reason.NOT_ADMITTED
            continue
        # decoding and hashing a whole model is torch work: off the event loop
        groups, got = await asyncio.get_running_loop().run_in_executor(None, decode_state, received)
        state_round = received.meta.get("phi_round")
        deadline = time.monotonic() + timeouts.state_announce_wait_s
        while True:
            fresh = {r.peer_id: r for r in cache.eligible()}
            expected = set() if source.peer_id not in fresh else expected_digests(
                fresh.values(), fresh[source.peer_id], manifest.protocol.name, state_round)
            # an announcement may lag the state it describes: look again soon, not at the cache's
            # pace (a member whose rounds are short shows a round's announcement only that long)
            if got in expected or source.peer_id not in fresh or time.monotonic() > deadline:
                break
            await asyncio.sleep(ANNOUNCEMENT_POLL_S)
            with contextlib.suppress(P2PError):
                await cache.refresh()
        if got not in expected:
            shown = ", ".join(sorted(d[:12] for d in expected)) or "none"
            errors.append(f"{source.peer_id}: state of round {state_round} has digest {got[:12]}, "
                          f"the digests announced for that round are: {shown}")
            continue
        return JoinState(int(received.meta.get("round", source.round)), groups,
                         dict(received.meta), source.peer_id)
    if errors and not_admitted == len(errors):
        raise AdmissionError(refused_admission(manifest.swarm.id,
                                               transport.identity.peer_id.to_base58(),
                                               f"all {not_admitted} members asked"))
    if errors:
        raise RuntimeError("late join failed: no member served a verifiable state ("
                           + "; ".join(errors[:3]) + "); retry later")
    return None


async def wait_for_members(cache: MemberCache, timeout_s: float) -> None:
    """Gives the DHT a moment to show existing members before deciding we are the first."""
    deadline = time.monotonic() + timeout_s
    while not cache.peers() and time.monotonic() < deadline:
        cache.refreshed.clear()
        try:
            await asyncio.wait_for(cache.refreshed.wait(), timeout=max(0.05, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            break
