"""The running node as a protocol's exchange sees it: the daemon builds one `Swarm`, and each
exchange takes it with its config section (`NoLoCoExchange(config, swarm, rng)`).

The exchanges choose peers only among `members.eligible()` (node/daemon/members.py: live, on our
manifest, not banned, admitted), report through `publish`, start background work through
`tasks`, and are called by the training thread through `bridge`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import PeerID

from node.config.settings import NodeTimeouts
from node.events import Event
from node.loop import BackgroundTasks, LoopBridge
from node.rounds.contributions import BanList
from node.rounds.state import StateLayout
from p2p.errors import P2PError
from p2p.limits import TransferLimits


@dataclass
class Swarm:
    loop: asyncio.AbstractEventLoop
    transport: Any      # p2p.streams.Transport: push, swap, request, on_push, on_swap, ban
    members: Any        # node.daemon.members.MemberCache: eligible(), update()
    bans: BanList
    peer_id: str
    manifest: str       # our manifest's digest
    bridge: LoopBridge
    tasks: BackgroundTasks
    publish: Callable[[Event], None]
    timeouts: NodeTimeouts
    # the late join's choice of state (node/daemon/state_quorum.py StateAdoption.run), given
    # our φ as the reference its checks judge by: what a DiLoCoX node that fell too far behind
    # its swarm adopts mid-run; None where there is none (benchmarks timing an exchange alone)
    adopt_state: Callable[[dict], Awaitable[Any]] | None = None
    # judges the link from what the exchange measured (node/rounds/link_watch.py); None where
    # no one is told (the simulator, benchmarks timing an exchange alone)
    link_watch: Any = None
    # the most payload bytes a member's round message may declare (node/rounds/message_sizes.py
    # round_message_bytes); None: the transport's bound only
    round_message_bytes: int | None = None
    # the byte layout of our outer state (node/rounds/state.py), for a DiLoCoX resync's download;
    # None where there is none
    state_layout: StateLayout | None = None

    @property
    def transfer_limits(self) -> TransferLimits:
        """The transport's limits; their defaults where the swarm has none (a unit test)."""
        return self.transport.limits if self.transport is not None else TransferLimits()

    def refuse(self, peer: str, reason: str, sentence: str) -> None:
        """A contribution of `peer` was refused (on the loop): logged, struck, maybe banned."""
        self.bans.refuse(peer, reason, sentence, self.transport.ban)

    def refuse_from_thread(self, peer: str, reason: str, sentence: str) -> None:
        """The same, from the training thread (the round classes' `link.refused`)."""
        self.bridge.post(self.refuse, peer, reason, sentence)


def failure_sentence(error: BaseException) -> str:
    """One sentence for a failed exchange: the network's own sentence, or the error's type and
    text for anything else (a bug, an encoding error) so that it is not mistaken for the network."""
    return str(error) if isinstance(error, P2PError) else f"{type(error).__name__}: {error}"


def peer_name(raw: bytes | PeerID | str) -> str:
    """A peer id as base58 text, whatever form the transport gave it in."""
    if isinstance(raw, str):
        return raw
    return (raw if isinstance(raw, PeerID) else PeerID(raw)).to_base58()
