"""Joining a swarm: connecting to it, then resuming our own state or taking the swarm's.

- Connect: p2pd and the DHT, the signed transport (admission and bans wired into it), our member
  record and the member cache, our manifest published under its digest.
- Resume or join late: a node with a checkpoint resumes from it; a node with none, in a swarm
  already past round 0, adopts a state on more than one member's word and starts at the round a
  majority reached (node/daemon/state_quorum.py: DiLoCoX, the digest a majority announced;
  NoLoCo, the state most of several members' states agree with; every state checked as a
  contribution, a lying server banned). Nothing is written until the state is complete and
  verified. A node resuming too far behind its swarm to pair (NoLoCo) or share φ (DiLoCoX)
  joins late the same way, keeping its inner optimizer and data position.
- A fresh swarm: the first node waits (bounded) for --min-peers others before round 0. Only a
  node given no peer to join through may be that first node: one given peers (--peer, the
  manifest's bootstrap peers) waits (bounded: `join_members_s`) until it sees a member.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from node.daemon.admission import publish_manifest
from node.daemon.members import MemberCache
from node.daemon.newcomers import NewcomerGate
from node.daemon.state_quorum import StateAdoption, agreed_round
from node.events import (CheckpointSkipped, LateJoined, MinPeersTimeout, ReachabilityFound, Resumed,
                         WaitingForPeers)
from node.rounds.contributions import BanList
from node.rounds.link_watch import LinkWatch
from node.rounds.policy import RoundPolicy
from node.rounds.swarm import Swarm
from node.train.trainer import InnerTrainer
from p2p.host import P2PHost
from p2p.identity import NodeIdentity
from p2p.membership import Membership
from p2p.reachability import ReachabilityOptions
from p2p.streams import Transport

if TYPE_CHECKING:
    from node.daemon.daemon import Daemon

log = logging.getLogger("lowcomm.join")
CHECKPOINT_FORMAT = 2


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
    limits = {} if node.transport_limits is None else dict(zip(("wire_limits", "limits"), node.transport_limits))
    network.transport = transport = Transport(host.p2p, identity, swarm=m.swarm.id, manifest=m.digest,
                                              **limits)
    # a member behind NAT forwards for no one: the swarm never depends on one (p2p/forwarding.py)
    transport.forwarder.enabled = host.reachability.mode != "private"
    admit = None
    if m.admission.mode == "allowlist":  # members refuse, and never call, unlisted keys
        admit = transport.admit = set(m.admission.public_keys).__contains__
    await transport.start()
    network.membership = Membership(host, m.swarm.id, protocol=m.protocol.name, manifest=m.digest,
                                    ttl_s=settings.member_ttl_s)
    await network.membership.start()
    bans = BanList(m.contributions.ban_after, m.contributions.ban_seconds)
    gate = NewcomerGate(m.admission.new_members_per_hour) if m.admission.new_members_per_hour else None
    network.cache = cache = MemberCache(network.membership, node.tasks, manifest=m.digest, bans=bans,
                                        refresh_s=settings.timeouts.member_refresh_s, admit=admit,
                                        gate=gate, vouch_s=settings.member_ttl_s,
                                        clock=network.membership.clocks.monotonic,
                                        idle_refresh_s=settings.timeouts.member_idle_refresh_s)
    await cache.start()
    transport.on_heard = cache.vouch  # a member whose stream came is alive while its lookups lag
    await publish_manifest(host.dht, m)
    transport.counters.on_refusal_issued = \
        lambda peer, reason: bans.transport_refusal(peer, reason.name, transport.ban)

    def forged_record(peer: str) -> None:  # a flooder sends many: strike until banned
        if not bans.is_banned(peer):
            bans.refuse(peer, "FORGED_RECORD", f"refused a member record that {peer} stored in our "
                        "DHT: it is not signed by the member it names (a forgery)", transport.ban,
                        counted_elsewhere=False)
    host.validator.on_forgery = forged_record
    return Swarm(node.loop, transport, cache, bans, identity.peer_id.to_base58(), m.digest,
                 node.bridge, node.tasks, node.events.publish, settings.timeouts,
                 round_message_bytes=node.round_message_bytes,
                 adopt_state=lambda reference: StateAdoption(transport, cache, bans, m,
                                                             settings.timeouts, reference).run(),
                 link_watch=LinkWatch(m, node.vocab_size, node.events.publish))


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
        lag = agreed_round(cache.eligible()) - trainer.step // H
        # Too far behind to pair (NoLoCo) or to share φ (DiLoCoX): catch up like a late
        # joiner, keeping our own inner optimizer and data position.
        if lag <= max(1, node.manifest.protocol.max_staleness):
            return trainer.step // H
    else:
        if joining_through_peers(node):
            await wait_to_see_members(cache, timeouts.join_members_s, node.manifest.swarm.id)
        else:
            await wait_for_members(cache, timeouts.first_members_s)
        if agreed_round(cache.eligible()) == 0:
            await wait_min_peers(node, cache)
            return 0
    own_phi = (await node.loop.run_in_executor(None, policy.export_state))[1]["phi"]
    adoption = StateAdoption(node.network.transport, cache, cache.bans, node.manifest, timeouts, own_phi)
    asked_at = time.monotonic()
    joined = await adoption.run()
    if joined is None:
        return trainer.step // H
    await node.loop.run_in_executor(None, policy.adopt, joined.tensors, joined.meta.get("phi_round"))
    start = joined.round_index
    trainer.start_at(start * H)
    node.events.publish(LateJoined(source=joined.source, round=start,
                                   state_round=joined.meta.get("phi_round"),
                                   digest=joined.meta.get("phi"), bytes_fetched=joined.bytes_fetched,
                                   state_bytes=adoption.layout.total, sources=joined.sources,
                                   download_s=round(time.monotonic() - asked_at, 3)))
    return start


async def wait_min_peers(node: Daemon, cache: MemberCache) -> None:
    """A swarm that starts together trains together: wait (bounded) for the others. Each change
    in what the cache shows is reported (the status view's peers, one log line), so a node kept
    waiting by members it does not count (banned ones) says so."""
    wanted = node.settings.min_peers
    deadline = node.loop.time() + node.settings.min_peers_timeout_s
    shown = None
    while node.loop.time() < deadline and not node.stop_event.is_set():
        seen = WaitingForPeers(wanted=wanted, eligible=len(cache.eligible()), alive=len(cache.peers()),
                               known=len(cache.records))
        if seen.fields() != shown and (shown is not None or seen.eligible < wanted):
            node.events.publish(seen)
            shown = seen.fields()
        if seen.eligible >= wanted:
            break
        cache.want_fresh()
        cache.refreshed.clear()
        try:
            await asyncio.wait_for(cache.refreshed.wait(), timeout=deadline - node.loop.time())
        except asyncio.TimeoutError:
            break
    if len(cache.eligible()) < wanted:
        node.events.publish(MinPeersTimeout(wanted=wanted, found=len(cache.eligible())))


def joining_through_peers(node: Daemon) -> bool:
    """Whether this node was given peers to join through (--peer, the manifest's bootstrap
    peers) other than itself: then a swarm exists, and the node must not start one."""
    own = f"/p2p/{node.network.host.peer_id.to_base58()}"
    return any(not address.rstrip("/").endswith(own)
               for address in [*node.settings.peers, *node.manifest.network.bootstrap_peers])


async def wait_to_see_members(cache: MemberCache, timeout_s: float, swarm: str) -> None:
    """Waits until the cache shows a member of the swarm (any round, even 0: a swarm starting
    together); RuntimeError in one sentence when none shows within `timeout_s`. A node joining
    through peers never decides from one look that it is the first: a DHT slow to answer, or
    split at start, would have it train alone from its initial weights."""
    await wait_for_members(cache, timeout_s)
    if not cache.peers():
        raise RuntimeError(f"no member of swarm {swarm!r} appeared within {timeout_s:g} s of "
                           f"joining through the given peers: check that they run this swarm "
                           f"(or start without --peer to begin a new one)")


async def wait_for_members(cache: MemberCache, timeout_s: float) -> None:
    """Gives the DHT a moment to show existing members before deciding we are the first."""
    deadline = time.monotonic() + timeout_s
    while not cache.peers() and time.monotonic() < deadline:
        cache.want_fresh()
        cache.refreshed.clear()
        try:
            await asyncio.wait_for(cache.refreshed.wait(), timeout=max(0.05, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            break
