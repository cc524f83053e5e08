"""Counters of the transport, kept for telemetry: messages and bytes per direction, refusals.

Bytes are counted where this package reads and writes its streams: frame prefixes, headers,
signatures, payloads and status frames. The libp2p layers below (yamux, TLS) add their own
overhead, which p2pd does not report per stream, so it is not included.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import PeerID

from p2p.errors import Reason, Refusal
from p2p.paths import PathCounts

_MAX_TRACKED_PEERS = 1024  # peer ids are free to mint: keep per-peer counts bounded


@dataclass
class TransportCounters:
    messages_sent: int = 0          # messages whose every frame we wrote and the peer accepted
    messages_received: int = 0      # incoming messages whose first header passed every check
    messages_verified: int = 0      # complete incoming messages that passed every check
    frames_sent: int = 0
    frames_received: int = 0        # frames whose payload digest matched
    bytes_sent: int = 0             # on our streams, everything we wrote
    bytes_received: int = 0         # on our streams, everything we read
    refused_incoming: Counter = field(default_factory=Counter)   # Reason name -> count, refusals we issued
    refused_outgoing: Counter = field(default_factory=Counter)   # Reason name -> count, refusals we got
    refusals_by_peer: OrderedDict = field(default_factory=OrderedDict)  # peer b58 -> refusals we issued
    # Told of every refusal this node issues to a known peer (the node strikes and bans on it).
    # Invariant: each refused stream or message is counted here exactly once, so one offence is
    # one call.
    on_refusal_issued: Callable[[str, Reason], None] | None = None
    paths: PathCounts = field(default_factory=PathCounts)   # streams direct / through a relay
    forwarded_streams: int = 0      # streams we forwarded between two other members (p2p/forwarding.py)
    forwarded_bytes: int = 0        # the bytes they carried, both ways
    refused_congested: int = 0      # of refused_incoming, those our own saturated link caused

    def count_refusal_issued(self, reason: Reason, peer: str | None, congested: bool = False) -> None:
        """`congested`: our own saturated link caused it (Refusal.congested): the peer is not
        told to the node's strikes, or a node on a slow link bans every honest member."""
        self.refused_incoming[reason.name] += 1
        if congested:
            self.refused_congested += 1
        if peer is not None:
            if self.on_refusal_issued is not None and not congested:
                self.on_refusal_issued(peer, reason)
            self.refusals_by_peer[peer] = self.refusals_by_peer.pop(peer, 0) + 1
            while len(self.refusals_by_peer) > _MAX_TRACKED_PEERS:
                self.refusals_by_peer.popitem(last=False)

    def count_refusal_received(self, reason: Reason) -> None:
        self.refused_outgoing[reason.name] += 1

    def snapshot(self) -> dict:
        """A plain dict (JSON-ready) of every counter."""
        return {
            "messages_sent": self.messages_sent, "messages_received": self.messages_received,
            "messages_verified": self.messages_verified, "frames_sent": self.frames_sent,
            "frames_received": self.frames_received, "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received, "refused_incoming": dict(self.refused_incoming),
            "refused_outgoing": dict(self.refused_outgoing), "refusals_by_peer": dict(self.refusals_by_peer),
            "forwarded_streams": self.forwarded_streams, "forwarded_bytes": self.forwarded_bytes,
            "refused_congested": self.refused_congested,
            **self.paths.snapshot(),
        }

    def counted_reply(self, reply: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        """`reply` (a swap's or request's reply handler, `reply(header)`), counting what it refuses.

        The transport counts a refused delivery, but a refusal raised by a reply handler fails the
        message before the stream's own handler sees it, so the transport never counted those
        (NOT_PAIRED, "no completed round yet", ...): the node's refused metrics missed them. Here
        each is counted once, against the header's sender (so a MISBEHAVIOUR reason strikes it as
        any refused stream does), and a handler that fails with another error as INTERNAL,
        against no one (our failure, not the peer's). Register every reply handler wrapped:
        `transport.on_swap(kind, transport.counters.counted_reply(reply), ...)`."""
        async def counted(header: Any) -> Any:
            try:
                return await reply(header)
            except Refusal as refusal:
                self.count_refusal_issued(refusal.reason, PeerID(header.sender).to_base58(),
                                          refusal.congested)
                raise
            except Exception:
                self.count_refusal_issued(Reason.INTERNAL, None)
                raise
        return counted
