"""How this machine runs its node: never part of the swarm's manifest, never in its digest.

`NodeSettings` comes from the `join` command line (node/cli.py). `NodeTimeouts` names every wait
of the daemon that is ours to choose, and `TransferLimits` (p2p/limits.py) the transport's
knobs (the protocol's own deadlines and the swarm's minimum link rate are in the manifest): an
operator changes any of them with `lowcomm-node join --set node.<name>=<value>`, and
`lowcomm-node settings` lists them with their units and meanings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from node.config.schema import ConfigError
from p2p.limits import NODE_SWARM_FIELDS, TransferLimits, described

NODE_PREFIX = "node."


@dataclass
class NodeTimeouts:
    """Seconds (or counts) the daemon waits; each bounds a wait that could otherwise hang. None
    of them cuts a transfer that keeps moving: those end by p2p/progress.py's rules."""

    loop_call_s: float = described(30.0, "seconds: a call of the training thread into the event loop, "
                                   "beyond the network wait it asks for (the loop answers in "
                                   "milliseconds unless it is stalled)")
    match_message_s: float = described(10.0, "seconds: a NoLoCo matching message on the wire, and how "
                                       "long a swap that overtook the accept of our proposal waits for it")
    consensus_wait_s: float = described(5.0, "seconds: DiLoCoX, how long a node waits for the members "
                                        "of a round to announce their phi digest")
    state_download_attempts: int = described(3, "count: the late join, members asked for the outer state")
    state_announce_wait_s: float = described(10.0, "seconds: the late join, how long an announcement "
                                             "lagging the state it describes is waited for")
    state_agreement_wait_s: float = described(120.0, "seconds: NoLoCo, a joiner whose asked states "
                                              "disagree waits this long for the swarm's next round before "
                                              "asking again (a round's length, generously)")
    first_members_s: float = described(2.0, "seconds: at start, without a checkpoint, how long the "
                                       "DHT may take to show existing members before a node given no "
                                       "peer thinks it is the first")
    join_members_s: float = described(120.0, "seconds: a node given peers (--peer, or the manifest's "
                                      "bootstrap peers) waits this long to see a member of its swarm: it "
                                      "is joining one, so it never starts its own; past this it stops "
                                      "with an error (node/daemon/join.py)")
    member_refresh_s: float = described(0.5, "seconds: between the member cache's DHT lookups while "
                                        "a decision waits on the view (a pairing, a vote, --min-peers)")
    member_idle_refresh_s: float = described(3.0, "seconds: between the member cache's DHT lookups "
                                             "while no decision waits on the view")
    alone_before_redial_s: float = described(10.0, "seconds: seeing no member this long, the node "
                                             "redials its bootstrap peers...")
    redial_every_s: float = described(10.0, "seconds: ...this often, while alone")
    watch_every_s: float = described(2.0, "seconds: between the daemon's looks at p2pd, stop requests "
                                     "and members")
    p2pd_start_s: float = described(15.0, "seconds: p2pd's start (a loaded machine takes longer)")
    leave_step_s: float = described(5.0, "seconds: each step of leaving (tombstone, stop serving, p2pd)")
    leave_drain_s: float = described(30.0, "seconds: a node that ended its schedule (no stop asked): "
                                     "how long its last messages may take to reach their peers before "
                                     "p2pd stops; a stop request keeps to leave_step_s / 2")
    leave_reserve_s: float = described(5.0, "seconds: of the grace period, what is kept for leaving "
                                       "once the training thread has stopped")


@dataclass
class NodeSettings:
    data_dir: Path
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)  # what peers dial, when not `listen`
    peers: list[str] = field(default_factory=list)
    grace_s: float = 25.0
    max_steps: int = 0            # stop after this many inner steps (0: the schedule's end)
    member_ttl_s: float = described(15.0, "seconds: our member record's time to live in the DHT (a "
                                    "member unheard of this long is gone)")
    port_mapping: bool = False
    reachability: str = "auto"   # auto (a bootstrap peer dials us back) | public | private
    relays: list[str] = field(default_factory=list)  # relay slots through these (default: bootstrap peers)
    seed: int = 0                 # for this node's choices (partners, groups), not its data
    ops: dict = field(default_factory=dict)  # node.ops.NodeOps options: mqtt, preemption, display
    min_peers: int = 0            # a fresh swarm: wait for this many other members before round 0
    min_peers_timeout_s: float = described(120.0, "seconds: a fresh swarm, the longest wait for "
                                           "--min-peers other members before round 0")
    round_end: str = "auto"       # DiLoCoX: "beside", the round's end in a thread beside training;
                                  # "auto": beside on CUDA (node/daemon/run.py)
    timeouts: NodeTimeouts = field(default_factory=NodeTimeouts)
    # the transport's knobs; its min_rate_bytes_per_s is the manifest's (node/rounds/message_sizes.py)
    transfer: TransferLimits = field(default_factory=TransferLimits)


def _settable() -> dict[str, dict]:
    """{group: {name: field}}: NodeSettings' own waits, NodeTimeouts' and the transport's knobs
    (all but the swarm's minimum link rate)."""
    return {"settings": {f.name: f for f in fields(NodeSettings) if "help" in f.metadata},
            "timeouts": {f.name: f for f in fields(NodeTimeouts)},
            "transfer": {f.name: f for f in fields(TransferLimits) if f.name not in NODE_SWARM_FIELDS}}


def node_settings() -> list[tuple[str, str, object, str]]:
    """(`node.<name>`, type, default, meaning) of every setting `join --set node.<name>=<value>`
    changes."""
    return [(f"{NODE_PREFIX}{name}", f.type if isinstance(f.type, str) else f.type.__name__, f.default,
             f.metadata["help"]) for group in _settable().values() for name, f in group.items()]


def apply_node_settings(settings: NodeSettings, overrides: list[tuple[str, object]]) -> None:
    """Sets each (`node.<name>`, value) of `overrides` on `settings`; ConfigError, one sentence,
    for an unknown name or a value of the wrong type or sign."""
    groups = _settable()
    values: dict[str, dict] = {group: {} for group in groups}
    for key, value in overrides:
        name = key.removeprefix(NODE_PREFIX)
        group = next((g for g, known in groups.items() if name in known), None)
        if group is None:
            raise ConfigError(f"unknown node setting '{key}': `lowcomm-node settings` lists them")
        integer = groups[group][name].type in ("int", int)
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if number is None or (integer and not isinstance(number, int)):
            raise ConfigError(f"node setting '{key}' must be {'an integer' if integer else 'a number'}, "
                              f"got {value!r}")
        if not number > 0:
            raise ConfigError(f"node setting '{key}' must be positive, got {value!r}")
        values[group][name] = number if integer else float(number)
    for name, value in values["settings"].items():
        setattr(settings, name, value)
    settings.timeouts = replace(settings.timeouts, **values["timeouts"])
    settings.transfer = replace(settings.transfer, **values["transfer"])
