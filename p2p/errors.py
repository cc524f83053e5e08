"""Errors of the network layer, and the reason codes a refused message carries on the wire.

Every refusal is answered to the sender with a `Reason` (a small integer on the wire) and a
short human detail, so that both ends log the same cause. Exceptions raised to callers are
subclasses of `P2PError`; their `str()` is one sentence that says what happened and, where
there is one, what to do about it.
"""

from __future__ import annotations

import enum


class Reason(enum.IntEnum):
    """Why a message was refused. Values are stable: they travel in status frames."""

    OK = 0
    BAD_SIGNATURE = 1     # signature invalid, or not made by the stream's authenticated peer
    WRONG_SWARM = 2       # header names another swarm
    WRONG_MANIFEST = 3    # header names another swarm manifest digest
    WRONG_RECIPIENT = 4   # the message was addressed to another peer
    STALE_ROUND = 5       # the receiver's round predicate rejected the round
    TOO_LARGE = 6         # a size bound (header, payload, tensors, elements) was exceeded
    BAD_DIGEST = 7        # payload bytes do not match the signed BLAKE2b digest
    MALFORMED = 8         # undecodable or inconsistent header or frame
    TRUNCATED = 9         # stream ended before the declared bytes arrived
    BUSY = 10             # per-peer limit on concurrent streams, or on recent messages, reached
    BANNED = 11           # the sender is banned for a while
    REPLAYED = 12         # this exact message (sender, nonce, frame) was already accepted
    WRONG_VERSION = 13    # unknown protocol version
    WRONG_SENDER = 14     # header's sender field differs from the stream's authenticated peer
    EXPIRED = 15          # sender timestamp outside the accepted clock window
    UNSUPPORTED = 16      # no handler for this message kind or mode
    TIMEOUT = 17          # the transfer did not finish within its deadline
    REFUSED = 18          # the application handler declined the message
    INTERNAL = 19         # the receiver failed while handling the message (its bug, not ours)
    NOT_ADMITTED = 20     # the swarm admits only listed keys, and the sender's is not listed
    NOT_PAIRED = 21       # a NoLoCo swap from a peer the receiver holds no pair with
    NO_ROOM = 22          # the receiver holds too many incoming bytes now (capacity, not misbehaviour)
    HELD = 23             # the receiver already holds this message (a member handed it on): nothing lost

    @classmethod
    def from_wire(cls, code: int) -> "Reason":
        """Map a wire code to a Reason; unknown codes (a newer peer) become MALFORMED."""
        try:
            return cls(code)
        except ValueError:
            return cls.MALFORMED


class P2PError(Exception):
    """Base class of every error raised by the p2p package."""


class IdentityError(P2PError):
    """The node's key file is missing, unreadable, of the wrong type or too open."""


class HostError(P2PError):
    """The P2P daemon or the DHT could not be started or used."""


class Refusal(P2PError):
    """A message check failed on this node; `reason` is sent back to the peer.

    Application handlers raise `Refusal(Reason.REFUSED, "...")` (or a more precise reason) to
    decline a message; the transport answers the sender with it.
    """

    def __init__(self, reason: Reason, detail: str = "", *, congested: bool = False):
        """`congested`: our own link, not the peer, most likely caused it (a stream idle while
        others filled our downlink, or our own half of a swap too slow): counted, but it strikes
        no one (p2p/progress.py)."""
        self.reason = Reason(reason)
        self.detail = detail
        self.congested = congested
        super().__init__(f"{self.reason.name}: {detail}" if detail else self.reason.name)


class RemoteRefused(P2PError):
    """The remote peer refused our message; raised on the sending side."""

    def __init__(self, peer: str, kind: str, reason: Reason, detail: str = ""):
        self.peer, self.kind, self.reason, self.detail = peer, kind, Reason(reason), detail
        super().__init__(f"peer {peer} refused our {kind!r} message: {self.reason.name}"
                         + (f" ({detail})" if detail else "") + ".")


class ReplyRejected(P2PError):
    """The remote peer's reply to our swap or request failed our checks (reason says which)."""

    def __init__(self, peer: str, kind: str, reason: Reason, detail: str = ""):
        self.peer, self.kind, self.reason, self.detail = peer, kind, Reason(reason), detail
        super().__init__(f"the reply of peer {peer} to our {kind!r} message was rejected: "
                         f"{self.reason.name}" + (f" ({detail})" if detail else "") + ".")


class LimitsError(P2PError):
    """A message, or the largest message a swarm exchanges, does not fit the transport's bounds."""


class TransferFailed(P2PError):
    """The stream could not be opened or broke before the exchange completed."""


class TransferTimeout(TransferFailed):
    """The exchange did not complete within its deadline."""
