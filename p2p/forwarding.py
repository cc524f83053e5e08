"""Streams between two members behind NAT, forwarded by a public member.

Why not the circuit relay alone: hivemind's p2pd (v0.5.0.hivemind1) starts two circuit-relay v2
services, the one its flags configure (4 GiB and 30 minutes a relayed connection) and, in
`EnableRelayV2`, a second with go-libp2p's defaults; whichever registers its handler last
serves. In our NAT testbed it was mostly the default, which resets a relayed connection after
128 KiB in either direction (p2pd's log with GOLOG_LOG_LEVEL=relay=debug: "relayed 131072
bytes", 48 times in one test), so home-to-home snapshots ended TRUNCATED. A relayed connection
still carries libp2p's own small messages (DHT, identify, hole punching).

So when the only connection to a peer is relayed, the transport opens its streams to that relay
instead, with FORWARD_PROTOCOL and a preamble naming the peer; the relay, a public member
running this code, opens a stream to the peer with FORWARDED_PROTOCOL and a preamble naming the
origin, and copies bytes both ways. Nothing else changes: the frames are signed end to end, the
header names sender and recipient (p2p/wire.py), so a forwarder can drop, delay or garble a
message but cannot forge or redirect one. The receiver blames the forwarder, not the origin, for
what a forwarder could have caused (see `blamed`).

Invariants: a forwarder copies at most `chunk_bytes` at a time per direction (no message is held
in its memory), at most `max_streams_per_peer` streams per origin and `MAX_FORWARDED_STREAMS` in
all; it never forwards onto a relayed connection (no chains), and a member behind NAT never
forwards (the swarm never depends on one to relay for others).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress

from hivemind.p2p import PeerID

from p2p.errors import Reason, Refusal
from p2p.framing import StreamIO
from p2p.limits import TransferLimits
from p2p.paths import is_relayed
from p2p.progress import Progress

logger = logging.getLogger("lowcomm.p2p.forwarding")
FORWARD_PROTOCOL = "/lowcomm/forward/1"      # origin -> forwarder: "open this stream to <peer>"
FORWARDED_PROTOCOL = "/lowcomm/forwarded/1"  # forwarder -> target: "this stream comes from <peer>"
MAX_FORWARDED_STREAMS = 64
_MAX_PEER_ID_BYTES = 64
GRACE_S = 2.0  # once one direction ended, the other's last bytes (a status) still get through
# Reasons a receiver reads from the origin's signed header, once its signature checked: only the
# origin could have caused them, so they count against it even on a forwarded stream. Everything
# else (a bad signature, garbled or replayed frames, a stall, a flood) a forwarder can cause.
SIGNED_BY_ORIGIN = frozenset({Reason.STALE_ROUND, Reason.TOO_LARGE, Reason.WRONG_SWARM, Reason.WRONG_MANIFEST,
                              Reason.UNSUPPORTED, Reason.REFUSED, Reason.NOT_PAIRED, Reason.BANNED,
                              Reason.NOT_ADMITTED, Reason.NO_ROOM, Reason.HELD})


def preamble(peer: PeerID) -> bytes:
    """The bytes that name a peer at the start of a forwarding stream: length, then its id."""
    raw = peer.to_bytes()
    return bytes([len(raw)]) + raw


async def read_preamble(reader: asyncio.StreamReader, timeout_s: float) -> PeerID:
    """The peer a forwarding stream names, or a Refusal saying what was wrong with it."""
    try:
        async with asyncio.timeout(timeout_s):
            length = (await reader.readexactly(1))[0]
            if not 0 < length <= _MAX_PEER_ID_BYTES:
                raise Refusal(Reason.MALFORMED, f"a forwarding preamble of {length} bytes names no peer")
            raw = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise Refusal(Reason.TRUNCATED, "the stream ended inside its forwarding preamble") from None
    except TimeoutError:
        raise Refusal(Reason.TIMEOUT, f"no forwarding preamble within {timeout_s:.0f} s") from None
    try:
        return PeerID(raw)
    except Exception:
        raise Refusal(Reason.MALFORMED, "the forwarding preamble does not hold a peer id") from None


def blamed(reason: Reason, origin: PeerID, forwarder: PeerID | None, head_verified: bool) -> PeerID:
    """Whom a refusal on an incoming stream counts against (and strikes, where it is misbehaviour)."""
    if forwarder is None or (head_verified and reason in SIGNED_BY_ORIGIN):
        return origin
    return forwarder


async def pipe(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
               b: tuple[asyncio.StreamReader, asyncio.StreamWriter], *, chunk_bytes: int, stall_s: float,
               max_bytes: int) -> tuple[int, int]:
    """Copy a -> b and b -> a until either side ends, no byte moved either way for `stall_s`
    (a push's status comes back only once the message is through: one direction idles while
    the other moves), or one side sends more than `max_bytes`; then close both. Returns the
    bytes copied each way."""
    copied = [0, 0]
    progress = Progress(TransferLimits(stall_s=stall_s), rate_bound=False)

    async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        while copied[index] < max_bytes:
            chunk = await progress.wait(lambda: reader.read(min(chunk_bytes, max_bytes - copied[index])))
            if not chunk:
                return
            writer.write(chunk)
            progress.moved(received=len(chunk))
            await progress.wait(writer.drain)
            copied[index] += len(chunk)

    tasks = [asyncio.create_task(copy(a[0], b[1], 0)), asyncio.create_task(copy(b[0], a[1], 1))]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            await asyncio.wait(pending, timeout=GRACE_S)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        for task in tasks:  # a broken or stalled side ends the forwarding; nothing to report
            if not task.cancelled():
                task.exception()
        for _, writer in (a, b):
            with suppress(Exception):
                writer.close()
    return copied[0], copied[1]


class Forwarder:
    """The forwarding member's side: one per Transport, serving FORWARD_PROTOCOL.

    `transport` gives the p2p daemon, the limits, the admission rule, the bans and the counters
    (forwarded_streams, forwarded_bytes); `enabled` is False on a member behind NAT, whose
    transport then does not serve FORWARD_PROTOCOL at all (a forwarding stream fails to open)."""

    def __init__(self, transport):
        self.transport = transport
        self.enabled = True
        self.active = 0

    async def serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        t = self.transport
        origin: PeerID = info.peer_id
        origin_bytes = origin.to_bytes()
        opened = False
        try:
            self._check_member(origin, "you")
            target = await read_preamble(reader, t.limits.stall_s)
            if target == t.p2p.peer_id or target == origin:
                raise Refusal(Reason.MALFORMED, "a forwarding stream must name a third peer")
            self._check_member(target, f"peer {target}")
            if self.active >= MAX_FORWARDED_STREAMS or not t._ledger.try_open_stream(origin_bytes):
                raise Refusal(Reason.BUSY, "this member forwards too many streams now; try again later")
            opened = True
            self.active += 1
            onward = await self._open_onward(target, origin)
            sent, returned = await pipe((reader, writer), onward, chunk_bytes=t.limits.chunk_bytes,
                                        stall_s=t.limits.stall_s,
                                        max_bytes=t.wire_limits.max_message_bytes + t.wire_limits.max_frame_bytes)
            t.counters.forwarded_streams += 1
            t.counters.forwarded_bytes += sent + returned
        except Refusal as refusal:
            logger.info("did not forward a stream from %s: %s (%s)", origin.to_base58()[-8:],
                        refusal.reason.name, refusal.detail)
            await _answer(reader, writer, refusal, t)
        except (ConnectionError, OSError, TimeoutError) as error:
            logger.info("a stream forwarded for %s broke: %s", origin.to_base58()[-8:], type(error).__name__)
        finally:
            if opened:
                self.active -= 1
                t._ledger.close_stream(origin_bytes)
            with suppress(Exception):
                writer.close()

    def _check_member(self, peer: PeerID, who: str) -> None:
        t = self.transport
        if t.admit is not None and not t.admit(peer.to_base58()):
            raise Refusal(Reason.NOT_ADMITTED, f"{who} is not admitted to this swarm")
        if t._bans.get(peer.to_bytes(), 0.0) > time.monotonic():
            raise Refusal(Reason.BANNED, f"this node has banned {who} for a while")

    async def _open_onward(self, target: PeerID, origin: PeerID):
        t = self.transport
        try:
            async with asyncio.timeout(t.limits.open_timeout_s):
                info, reader, writer = await t.p2p.call_binary_stream_handler(target, FORWARDED_PROTOCOL)
        except TimeoutError:
            raise Refusal(Reason.TIMEOUT, f"could not reach peer {target} within "
                                          f"{t.limits.open_timeout_s:.0f} s to forward to it") from None
        except Exception as error:
            raise Refusal(Reason.UNSUPPORTED, f"could not open a stream to peer {target} to forward to "
                                              f"it ({type(error).__name__})") from None
        if is_relayed(info.addr):
            writer.close()
            raise Refusal(Reason.UNSUPPORTED, f"peer {target} is reachable from here only through a relay; "
                                              "this member forwards only onto direct connections")
        writer.write(preamble(origin))
        return reader, writer


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, refusal: Refusal,
                  transport) -> None:
    """A refusal as a status frame, which the origin reads as the exchange's answer; what the
    origin still sends is drained first (`StreamIO.linger`), or closing with it unread would
    reset the stream and the reset could overtake the status."""
    io = StreamIO(reader, writer, transport.counters, 2.0)
    with suppress(Exception):
        async with asyncio.timeout(2.0):
            await io.write_status(refusal.reason, f"forwarder: {refusal.detail}")
    await io.linger()
