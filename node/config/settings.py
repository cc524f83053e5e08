"""How this machine runs its node: never part of the swarm's manifest, never in its digest.

`NodeSettings` comes from the `join` command line (node/cli.py). `NodeTimeouts` names every wait
of the daemon that is ours to choose (the protocol's own deadlines are in the manifest):
one place to read them, and one to change them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class NodeTimeouts:
    """Seconds (or counts) the daemon waits; each bounds a wait that could otherwise hang."""

    # a call of the training thread into the event loop, beyond the network wait it asks for
    # (node/loop.py LoopBridge): the loop answers in milliseconds unless it is stalled
    loop_call_s: float = 30.0
    # a NoLoCo matching message on the wire, and how long a swap that overtook the accept of
    # our proposal waits for it (node/rounds/noloco/exchange.py)
    match_message_s: float = 10.0
    # DiLoCoX: how long a node waits for the members of a round to announce their φ digest
    consensus_wait_s: float = 5.0
    # the late join: members asked for the outer state, and how long an announcement lagging the
    # state it describes is waited for
    state_download_attempts: int = 3
    state_announce_wait_s: float = 10.0
    # a state download moves ranges of the state (node/rounds/state_fetch.py), each allowed its
    # bytes at this rate (bytes/s; 1 Mbit/s: a slow home uplink) plus `state_range_base_s`
    # (opening streams, round trips): no fixed bound on the whole download, which takes as long
    # as its bytes need on any link at least this fast; a stalled one ends on the transport's
    # idle bound (p2p/limits.py idle_timeout_s)
    state_min_rate_bytes_per_s: float = 128 * 1024
    state_range_base_s: float = 30.0
    # NoLoCo: a joiner whose asked states disagree waits this long for the swarm's next round
    # before asking again (a round's length, generously)
    state_agreement_wait_s: float = 120.0
    # at start: how long the DHT may take to show existing members before we think we are first
    first_members_s: float = 2.0
    member_refresh_s: float = 0.5       # the member cache's DHT lookups
    alone_before_redial_s: float = 10.0  # seeing no member this long, the node redials...
    redial_every_s: float = 10.0         # ...this often, while alone
    watch_every_s: float = 2.0           # the daemon's look at p2pd, stop requests and members
    p2pd_start_s: float = 15.0           # p2pd's start (a loaded machine takes longer)
    leave_step_s: float = 5.0            # each step of leaving (tombstone, stop serving, p2pd)
    # a node that ended its schedule (no stop asked): how long its last messages may take to
    # reach their peers before p2pd stops; a stop request keeps to leave_step_s / 2
    leave_drain_s: float = 30.0
    # of the grace period, what is kept for leaving once the training thread has stopped
    leave_reserve_s: float = 5.0

    def state_range_s(self, nbytes: int) -> float:
        """How long a range of `nbytes` of a state download may take (see above)."""
        return self.state_range_base_s + nbytes / self.state_min_rate_bytes_per_s


@dataclass
class NodeSettings:
    data_dir: Path
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)  # what peers dial, when not `listen`
    peers: list[str] = field(default_factory=list)
    grace_s: float = 25.0
    max_steps: int = 0            # stop after this many inner steps (0: the schedule's end)
    member_ttl_s: float = 15.0
    port_mapping: bool = False
    reachability: str = "auto"   # auto (a bootstrap peer dials us back) | public | private
    relays: list[str] = field(default_factory=list)  # relay slots through these (default: bootstrap peers)
    seed: int = 0                 # for this node's choices (partners, groups), not its data
    ops: dict = field(default_factory=dict)  # node.ops.NodeOps options: mqtt, preemption, display
    min_peers: int = 0            # a fresh swarm: wait for this many other members before round 0
    min_peers_timeout_s: float = 120.0
    round_end: str = "auto"       # DiLoCoX: "beside", the round's end in a thread beside training;
                                  # "auto": beside on CUDA (node/daemon/run.py)
    timeouts: NodeTimeouts = field(default_factory=NodeTimeouts)
