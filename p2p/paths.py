"""Which way each stream goes, direct or through a circuit relay, and what a relay will carry.

A member behind NAT is reached through a relay until a hole is punched (DCUtR); libp2p opens new
streams on the best connection it holds, so a direct one is used as soon as it exists. A relay
(p2pd's defaults, which our public members run) resets a relayed connection after 4 GiB per
direction or 30 minutes: a transfer larger than the data limit is refused before it starts, with
the reason, instead of being cut near its end and retried every round.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import varint
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

GiB = 1 << 30
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
    """What we send over one relayed connection: below p2pd's 4 GiB per direction, with margin
    for framing and for the other transfers sharing that connection. p2pd's 30-minute limit is
    on the connection's age, not on one transfer: a transfer it cuts fails like any broken
    stream (not measured here)."""

    max_bytes: int = 3 * GiB

    def refusal(self, nbytes: int) -> str | None:
        """Why a transfer of `nbytes` must not go through a relay (or None)."""
        if nbytes > self.max_bytes:
            return (f"{_size(nbytes)} would cross a relay, and relays cut a connection after 4 GiB (we send "
                    f"at most {_size(self.max_bytes)} that way); it needs a direct connection (a forwarded "
                    f"port on either side)")
        return None


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / 1e6:.1f} MB"


@dataclass
class PathCounts:
    """Streams opened (by us or to us) per path; the peers we reached only through a relay."""

    direct: int = 0
    relayed: int = 0
    relayed_by_peer: OrderedDict = field(default_factory=OrderedDict)  # peer b58 -> streams
    direct_by_peer: OrderedDict = field(default_factory=OrderedDict)

    def note(self, peer: str, maddr: Multiaddr | str) -> bool:
        """Counts one stream on the connection at `maddr`; True when it is relayed."""
        relayed = is_relayed(maddr)
        table = self.relayed_by_peer if relayed else self.direct_by_peer
        if relayed:
            self.relayed += 1
        else:
            self.direct += 1
        table[peer] = table.pop(peer, 0) + 1
        while len(table) > _MAX_TRACKED_PEERS:
            table.popitem(last=False)
        return relayed

    def snapshot(self) -> dict:
        return {"streams_direct": self.direct, "streams_relayed": self.relayed,
                "relayed_by_peer": dict(self.relayed_by_peer), "direct_by_peer": dict(self.direct_by_peer)}
