"""Which way each stream goes (direct, through a circuit relay, or forwarded by a member) and what
a circuit relay will carry.

A member behind NAT is reached through a relay until a hole is punched (DCUtR); libp2p opens new
streams on the best connection it holds, so a direct one is used as soon as it exists. Our public
members run p2pd's relay, and which limits it applies is a race inside p2pd (p2p/forwarding.py):
4 GiB per direction and 30 minutes a relayed connection, or go-libp2p's defaults, 128 KiB and 2
minutes, which is what our NAT testbed mostly got. So the transport forwards its streams through
a member instead of sending them over a relayed connection (p2p/forwarding.py), and where no member
forwards, a transfer larger than the smaller limit is refused before it starts, with the reason,
instead of being cut midway and retried every round.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import varint
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

KiB, GiB = 1 << 10, 1 << 30
_MAX_TRACKED_PEERS = 1024


def is_relayed(maddr: Multiaddr | str) -> bool:
    return "/p2p-circuit" in str(maddr)


def for_p2pd(maddr: Multiaddr | str) -> Multiaddr:
    """`maddr` with each /p2p/ component encoded as p2pd decodes it (a bare multihash).

    hivemind's multiaddr encodes a /p2p/ value as a CID (0x01 0x72 + multihash), which p2pd
    rejects ("length greater than remaining number of bytes in buffer"): dialling a relayed
    address (/p2p/<relay>/p2p-circuit) through p2pd's control API failed that way (measured)."""
    encoded = b""
    for protocol, value in Multiaddr(str(maddr)).items():
        if protocol.name == "p2p":
            multihash = PeerID.from_base58(value).to_bytes()
            encoded += varint.encode(protocol.code) + varint.encode(len(multihash)) + multihash
        else:
            encoded += Multiaddr(f"/{protocol.name}" + (f"/{value}" if value is not None else "")).to_bytes()
    return Multiaddr(encoded)


@dataclass(frozen=True)
class RelayLimits:
    """What we send over one relayed connection: below go-libp2p's default relay limit (128 KiB
    per direction a connection, shared with the other streams on it and libp2p's own messages),
    with margin. A relay running p2pd's configured limits would carry more, but neither end can
    tell which limits it runs."""

    max_bytes: int = 64 * KiB

    def refusal(self, nbytes: int) -> str | None:
        """Why a transfer of `nbytes` must not go through a relay (or None)."""
        if nbytes > self.max_bytes:
            return (f"{_size(nbytes)} would cross a circuit relay, which may cut a connection after 128 KiB "
                    f"(we send at most {_size(self.max_bytes)} that way), and no member forwarded it; it needs "
                    f"a direct connection (a forwarded port on either side) or a public member that forwards")
        return None


def _size(nbytes: int) -> str:
    if nbytes >= GiB // 10:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / KiB:.0f} KiB"


@dataclass
class PathCounts:
    """Streams opened (by us or to us) per path; the peers we reached only through a relay."""

    direct: int = 0
    relayed: int = 0
    forwarded: int = 0   # our streams that a member forwarded (p2p/forwarding.py), to us or from us
    relayed_by_peer: OrderedDict = field(default_factory=OrderedDict)  # peer b58 -> streams
    direct_by_peer: OrderedDict = field(default_factory=OrderedDict)
    forwarded_by_peer: OrderedDict = field(default_factory=OrderedDict)

    def note(self, peer: str, maddr: Multiaddr | str) -> bool:
        """Counts one stream on the connection at `maddr`; True when it is relayed."""
        relayed = is_relayed(maddr)
        if relayed:
            self.relayed += 1
        else:
            self.direct += 1
        _count(self.relayed_by_peer if relayed else self.direct_by_peer, peer)
        return relayed

    def note_forwarded(self, peer: str) -> None:
        """Counts one stream with `peer` that a member forwarded."""
        self.forwarded += 1
        _count(self.forwarded_by_peer, peer)

    def snapshot(self) -> dict:
        return {"streams_direct": self.direct, "streams_relayed": self.relayed,
                "streams_forwarded": self.forwarded, "relayed_by_peer": dict(self.relayed_by_peer),
                "direct_by_peer": dict(self.direct_by_peer), "forwarded_by_peer": dict(self.forwarded_by_peer)}


def relay_of(maddr: Multiaddr | str) -> str | None:
    """The relay's peer id in a relayed address (/.../p2p/<relay>/p2p-circuit...), else None."""
    text = str(maddr)
    if "/p2p-circuit" not in text:
        return None
    before = text.split("/p2p-circuit")[0]
    return before.rsplit("/p2p/", 1)[1] if "/p2p/" in before else None


def _count(table: OrderedDict, peer: str) -> None:
    table[peer] = table.pop(peer, 0) + 1
    while len(table) > _MAX_TRACKED_PEERS:
        table.popitem(last=False)
