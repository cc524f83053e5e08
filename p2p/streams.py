"""Signed message exchanges over hivemind binary streams: push, swap and request.

    transport = Transport(host.p2p, identity, swarm="demo", manifest=digest)
    transport.on_push("dilocox/grad", deliver, accept_round=lambda r: abs(r - current) <= 1)
    transport.on_swap("noloco/snapshot", reply, deliver=apply, accept_round=...)
    transport.on_request("state", respond, accept_round=lambda r: True)
    await transport.start()
    await transport.push(peer, OutgoingMessage(...))          # returns once the peer accepted it
    answer = await transport.swap(peer, OutgoingMessage(...))  # both directions at once
    state = await transport.request(peer, "state", round=r)

Each exchange opens `streams` binary streams (one per `frame_bytes` of payload, up to
`TransferLimits.parallel_streams`; a single yamux stream is window-limited on long round trips).
Per direction each stream carries signed frames, then one status. The receiver checks every
header (wire.check_head, then the handler's round predicate, then the replay guard), reserves
the payload bytes per peer and globally, reads into one buffer while hashing, and answers with
a status: OK, or the refusal reason, which the sender raises as `RemoteRefused`. This file is the
sending side; the receiving side, where a message is verified, is p2p/serving.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

from hivemind.p2p import P2P, PeerID

from p2p.assembly import Assembly, BoundWork
from p2p.counters import TransportCounters
from p2p.errors import (HostError, Reason, Refusal, RemoteRefused, ReplyRejected,
                        TransferFailed, TransferTimeout)
from p2p.forwarding import FORWARD_PROTOCOL, FORWARDED_PROTOCOL, Forwarder, preamble
from p2p.framing import PeerStatus, StreamIO
from p2p.identity import NodeIdentity
from p2p.limits import InflightLedger, TransferLimits, WireLimits
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.paths import RelayLimits, relay_of
from p2p.progress import NeedBy, Progress
from p2p.replay import RefusedMessages, ReplayGuard
from p2p.sending import SendPlan, choose_streams, send_stream_frames
from p2p.serving import (STREAM_PROTOCOL, IncomingStreams, RoundPredicate, SizePredicate, _check_size,
                         _Handler)
from p2p.wire import Expectations, MessageHeader, Mode, check_head

logger = logging.getLogger("lowcomm.p2p.streams")
NO_FORWARD_RETRY_S = 60.0  # a relay that did not forward is asked again after this long
FORWARD_RECHECK_S = 20.0   # a peer we forward to is tried directly again (and a hole punched) after this long
PING_PROTOCOL = "/ipfs/ping/1.0.0"  # served by every p2pd: a stream that only makes a connection
_MAX_TRACKED_PEERS = 1024


def _bounded_put(table: OrderedDict, key, value) -> None:
    table.pop(key, None)
    table[key] = value
    while len(table) > _MAX_TRACKED_PEERS:
        table.popitem(last=False)


def _peer_id(peer: PeerID | str | bytes) -> PeerID:
    if isinstance(peer, PeerID):
        return peer
    if isinstance(peer, str):
        try:
            return PeerID.from_base58(peer)
        except ValueError:
            raise ValueError(f"{peer!r} is not a base58 peer id (12D3KooW...).") from None
    return PeerID(bytes(peer))


class Transport(IncomingStreams):
    """This node's end of every signed exchange; one per node, living in the daemon's loop."""

    def __init__(self, p2p: P2P, identity: NodeIdentity, *, swarm: str, manifest: str,
                 wire_limits: WireLimits = WireLimits(), limits: TransferLimits = TransferLimits(),
                 protocol: str = STREAM_PROTOCOL):
        if p2p.peer_id != identity.peer_id:
            raise HostError("the P2P daemon runs under another identity than the one given to the transport; "
                            "start it with identity_path=identity.path.")
        self.p2p, self.identity, self.swarm, self.manifest = p2p, identity, swarm, manifest
        self.wire_limits, self.limits, self.protocol = wire_limits, limits, protocol
        self.counters = TransportCounters()
        self.relay_limits = RelayLimits()  # what we send over a relayed connection (p2p/paths.py)
        # streams to a peer reached only through a relay go through a forwarding member instead
        # (p2p/forwarding.py): the peer -> the relay that forwards for it, learnt from the relayed
        # address of a stream opened to it
        self.forwarder = Forwarder(self)
        self._forward_via: OrderedDict[bytes, tuple[PeerID, float]] = OrderedDict()  # until when
        self._no_forward: OrderedDict[bytes, float] = OrderedDict()  # relay -> when to ask it again
        self.forward_recheck_s = FORWARD_RECHECK_S
        self._expect = Expectations(swarm, manifest, identity.peer_id.to_bytes(), wire_limits)
        self._ledger = InflightLedger(limits)
        self._replay = ReplayGuard(wire_limits.max_clock_skew_s)
        self._refused = RefusedMessages()
        self._handlers: dict[tuple[str, int], _Handler] = {}
        self._assemblies: dict[tuple[bytes, bytes], Assembly] = {}
        self._bans: dict[bytes, float] = {}
        # Admission: None admits every peer; otherwise a peer for which it returns False has each
        # stream refused NOT_ADMITTED before anything of it is read.
        self.admit: Callable[[str], bool] | None = None
        # Called with the peer id of every stream whose signed head checked, whatever is then
        # refused: that peer is alive (the member cache keeps it in view: MemberCache.vouch).
        self.on_heard: Callable[[str], None] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lowcomm-hash")
        self._started = False

    # ------------------------------------------------------------------ registration and life

    def on_push(self, kind: str, deliver: Callable[[ReceivedMessage], Awaitable[None]], *,
                accept_round: RoundPredicate, accept_bytes: SizePredicate | None = None,
                check_head: Callable[[MessageHeader], None] | None = None) -> None:
        """Accept one-way messages of `kind`; `deliver` may raise Refusal to refuse one.
        `accept_bytes(declared payload bytes)` false: refused TOO_LARGE before reading.
        `check_head(header)` may raise Refusal to refuse a message before its payload is read."""
        self._handlers[(kind, Mode.PUSH)] = _Handler(Mode.PUSH, accept_round, deliver, None, accept_bytes,
                                                     check_head)

    def on_swap(self, kind: str, reply: Callable[[MessageHeader], Awaitable[OutgoingMessage]], *,
                accept_round: RoundPredicate,
                deliver: Callable[[ReceivedMessage], Awaitable[None]] | None = None,
                accept_bytes: SizePredicate | None = None) -> None:
        """Answer swaps of `kind`: `reply(header)` gives our half as soon as the peer's header is
        checked (both halves then travel at once); `deliver(message)` gets the peer's half."""
        self._handlers[(kind, Mode.SWAP)] = _Handler(Mode.SWAP, accept_round, deliver, reply, accept_bytes)

    def on_request(self, kind: str, respond: Callable[[MessageHeader], Awaitable[OutgoingMessage]], *,
                   accept_round: RoundPredicate,
                   finished: Callable[[MessageHeader], None] | None = None) -> None:
        """Answer requests of `kind` (a swap whose asking half is empty): `respond(header)`.
        `finished(header)` is called once that request's exchange is over (our reply sent and the
        statuses exchanged, or the exchange failed, whether or not `respond` returned): the reply
        message is no longer read after it."""
        self._handlers[(kind, Mode.SWAP)] = _Handler(Mode.SWAP, accept_round, None, respond,
                                                     finished=finished)

    def ban(self, peer: PeerID | str, seconds: float) -> None:
        """Refuse every stream of `peer` with BANNED for `seconds`."""
        now = time.monotonic()
        for banned in [p for p, until in self._bans.items() if until <= now]:  # keep the table small
            del self._bans[banned]
        self._bans[_peer_id(peer).to_bytes()] = now + seconds

    def unban(self, peer: PeerID | str) -> None:
        self._bans.pop(_peer_id(peer).to_bytes(), None)

    def receiving(self, peer: PeerID | str, kind: str, round: int | None = None) -> bool:
        """True while a message of `kind` and `round` (None: any) from `peer` is arriving (its
        first frame came, its last not yet): asking someone else for it would only bring it
        twice, and one who waits for it knows it is on its way."""
        raw = _peer_id(peer).to_bytes()
        return any(key[0] == raw and a.first.kind == kind and round in (None, a.first.round)
                   for key, a in self._assemblies.items())

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.protocol, self._serve)
        if self.forwarder.enabled:  # a member behind NAT offers no forwarding: opening one fails at once
            await self.p2p.add_binary_stream_handler(FORWARD_PROTOCOL, self.forwarder.serve)
        await self.p2p.add_binary_stream_handler(FORWARDED_PROTOCOL, self._serve_forwarded)
        self._started = True

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop serving: cancel in-flight exchanges and free every buffer. A stopped transport
        cannot be started again (its hashing threads are released). `grace_s`: first wait up to
        this long for exchanges in flight to end (a leaving node's reply to the swap that ended
        its last round is still on its way: cut, the partner's round fails)."""
        if self._started:
            self._started = False
            for protocol in (self.protocol, FORWARD_PROTOCOL, FORWARDED_PROTOCOL):
                with suppress(Exception):  # the daemon may already be gone
                    await self.p2p.remove_binary_stream_handler(protocol)
        if grace_s > 0 and self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        for assembly in list(self._assemblies.values()):
            assembly.fail(Refusal(Reason.BUSY, "the node is shutting down"))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ calling a peer

    async def push(self, peer: PeerID | str, message: OutgoingMessage, *, streams: int | None = None,
                   need_by: NeedBy | None = None) -> None:
        """Send `message` one way; return when the peer verified and accepted it.

        Raises RemoteRefused (with the peer's reason), TransferTimeout (it could not finish by
        `need_by`, default what its bytes take at the swarm's minimum link rate:
        p2p/progress.py) or TransferFailed (among others: it stalled).
        """
        await self._call(_peer_id(peer), message, Mode.PUSH, streams, need_by, None, 0)

    async def swap(self, peer: PeerID | str, message: OutgoingMessage, *, streams: int | None = None,
                   need_by: NeedBy | None = None, accept_round: RoundPredicate | None = None,
                   expected_reply_bytes: int = 0, accept_bytes: SizePredicate | None = None
                   ) -> ReceivedMessage:
        """Send `message` and receive the peer's reply at the same time, on the same streams.

        Raises RemoteRefused, ReplyRejected (the reply failed our checks), TransferTimeout or
        TransferFailed, as `push` does. `expected_reply_bytes` sizes the default streams and
        need-by until the reply's header declares its size;
        `accept_bytes` false for the reply's declared size rejects it before reading it.
        """
        return await self._call(_peer_id(peer), message, Mode.SWAP, streams, need_by, accept_round,
                                expected_reply_bytes, accept_bytes=accept_bytes)

    async def request(self, peer: PeerID | str, kind: str, round: int, *, meta: dict | None = None,
                      streams: int | None = None, need_by: NeedBy | None = None,
                      accept_round: RoundPredicate | None = None,
                      expected_reply_bytes: int = 0) -> ReceivedMessage:
        """Ask `peer` for a message of `kind` (e.g. its state); a swap with an empty payload.

        Replies of unknown size should pass `streams=transport.limits.parallel_streams`.
        """
        return await self.swap(peer, OutgoingMessage(kind, round, (), dict(meta or {})), streams=streams,
                               need_by=need_by, accept_round=accept_round,
                               expected_reply_bytes=expected_reply_bytes)

    async def _call(self, peer: PeerID, message: OutgoingMessage, mode: int, streams: int | None,
                    need_by: NeedBy | None, accept_round: RoundPredicate | None, expected_reply_bytes: int,
                    *, accept_bytes: SizePredicate | None = None):
        largest = max(message.total_bytes, expected_reply_bytes)
        streams = streams or choose_streams(largest, self.limits, self.wire_limits)
        plan = SendPlan(self.identity, swarm=self.swarm, manifest=self.manifest, recipient=peer.to_bytes(),
                        message=message, mode=mode, streams=streams, limits=self.limits, wire=self.wire_limits)
        # one progress for all the streams, both ways: the exchange ends when done, stalled, or
        # unable to finish by its need-by (p2p/progress.py), never at a fixed time
        progress = Progress(self.limits, sending=message.total_bytes, receiving=expected_reply_bytes,
                            need_by=need_by, counters=self.counters)
        reply = _ReplyState(progress)
        ios: list[StreamIO] = []
        try:
            ios = await self._open(peer, plan.streams)
            refusal = self._relay_refusal(ios, largest)
            if refusal:
                raise TransferFailed(f"the {Mode.NAMES[mode]} of {message.kind!r} with peer {peer} was not "
                                     f"started: {refusal}.")
            for io in ios:
                io.progress = progress
            if mode == Mode.PUSH:
                work = [self._push_stream(peer, io, plan, s) for s, io in enumerate(ios)]
            else:
                work = [self._swap_stream(peer, io, plan, s, reply, accept_round, accept_bytes)
                        for s, io in enumerate(ios)]
            await _all_or_first_error(work)
        except Refusal as refusal:  # a local check on the peer's stream behaviour (truncation, stall, ...)
            if refusal is progress.failure and progress.too_slow:
                raise TransferTimeout(f"the {Mode.NAMES[mode]} of {message.kind!r} with peer {peer} was "
                                      f"given up: {refusal.detail}.") from None
            raise TransferFailed(f"the {Mode.NAMES[mode]} of {message.kind!r} with peer {peer} failed: "
                                 f"{refusal.reason.name} ({refusal.detail}).") from None
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            raise TransferFailed(f"the stream to peer {peer} broke during the {Mode.NAMES[mode]} of "
                                 f"{message.kind!r} ({type(error).__name__}: {error}).") from None
        finally:
            for io in ios:
                io.close()
            if reply.assembly is not None:
                reply.assembly.fail(Refusal(Reason.TIMEOUT, "exchange abandoned"))
        self.counters.messages_sent += 1
        if mode == Mode.PUSH:
            return None
        self.counters.messages_verified += 1
        return reply.assembly.complete.result()

    async def _open(self, peer: PeerID, count: int) -> list[StreamIO]:
        """`count` streams to `peer`: direct where libp2p has a direct connection; where it has
        only a relayed one, through the relay as a forwarding member (p2p/forwarding.py); on a
        relayed connection only where that relay does not forward (`_relay_refusal` then bounds
        the size)."""
        key = peer.to_bytes()
        via, until = self._forward_via.get(key, (None, 0.0))
        if until <= time.monotonic():  # now and then libp2p's own way again: a hole may be punched
            if via is None:  # our streams show the path (relayed ones are closed unused: once)
                ios = await self._open_streams(peer, count)
                relay = next((relay_of(io.addr) for io in ios if io.relayed), None)
            else:  # a recheck: a ping stream shows the path without touching the peer's transport
                ios, relay = [], await self._relay_on_the_way(peer)
            if relay is None or not self._forwards(via := PeerID.from_base58(relay)):
                self._forward_via.pop(key, None)
                return ios or await self._open_streams(peer, count)
            for io in ios:
                io.close()
            self.forward_through(peer, via, self.forward_recheck_s)
            task = asyncio.create_task(self._punch_again(peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            return await self._open_streams(via, count, forward_to=peer)
        except TransferFailed as failure:
            # the relay forwards nothing (behind NAT, not one of our members, or gone): for a
            # while the relayed connection carries what its limits allow (`_relay_refusal`)
            self._forward_via.pop(key, None)
            _bounded_put(self._no_forward, via.to_bytes(), time.monotonic() + NO_FORWARD_RETRY_S)
            logger.info("member %s does not forward to %s (%s); using the relayed connection", via, peer, failure)
            return await self._open_streams(peer, count)

    async def _relay_on_the_way(self, peer: PeerID) -> str | None:
        """The relay our connection to `peer` goes through (None: direct, or no connection)."""
        try:
            async with asyncio.timeout(self.limits.open_timeout_s):
                info, _, writer = await self.p2p.call_binary_stream_handler(peer, PING_PROTOCOL)
        except Exception:  # unreachable: opening our own streams says so in its words
            return None
        writer.close()
        return relay_of(info.addr)

    async def _punch_again(self, peer: PeerID) -> None:
        """Drop the relayed connection to `peer` and dial it again: a fresh relayed connection is
        what starts DCUtR (libp2p punches once per relayed connection, and the first one between
        two homes usually came before either knew its public address: "protocols not supported:
        /libp2p/dcutr" in p2pd's log). A punched hole shows at the next recheck as a direct path."""
        try:
            async with asyncio.timeout(self.limits.open_timeout_s):
                await self.p2p._client.disconnect(peer)
                _, _, writer = await self.p2p.call_binary_stream_handler(peer, PING_PROTOCOL)
                writer.close()
        except Exception as error:  # the next recheck tries again; forwarding carries on meanwhile
            logger.info("could not redial %s through its relay to punch a hole: %s", peer, error)

    def forward_through(self, peer: PeerID, member: PeerID, seconds: float = FORWARD_RECHECK_S) -> None:
        """Send our streams to `peer` through `member` (p2p/forwarding.py) for `seconds`."""
        _bounded_put(self._forward_via, peer.to_bytes(), (member, time.monotonic() + seconds))

    def _forwards(self, relay: PeerID) -> bool:
        return relay != self.p2p.peer_id and self._no_forward.get(relay.to_bytes(), 0.0) <= time.monotonic()

    async def _open_streams(self, peer: PeerID, count: int, forward_to: PeerID | None = None) -> list[StreamIO]:
        target = forward_to or peer
        protocol = self.protocol if forward_to is None else FORWARD_PROTOCOL
        through = "" if forward_to is None else f" through member {peer}"

        async def open_one() -> StreamIO:
            try:
                async with asyncio.timeout(self.limits.open_timeout_s):
                    info, reader, writer = await self.p2p.call_binary_stream_handler(peer, protocol)
            except TimeoutError:
                raise TransferFailed(f"could not open a stream to peer {target}{through} within "
                                     f"{self.limits.open_timeout_s:.0f} s.") from None
            except (TransferFailed, asyncio.CancelledError):
                raise
            except Exception as error:  # the daemon reports dial failures as several error types
                raise TransferFailed(f"could not open a stream to peer {target}{through}: {error}.") from None
            io = StreamIO(reader, writer, self.counters, self.limits.stall_s, self._executor)
            io.addr = info.addr
            if forward_to is None:
                io.relayed = self.counters.paths.note(peer.to_base58(), info.addr)
            else:
                writer.write(preamble(forward_to))
                self.counters.paths.note_forwarded(forward_to.to_base58())
            return io

        tasks = [asyncio.create_task(open_one()) for _ in range(count)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with suppress(BaseException):
                    (await task).close()
            raise

    def _relay_refusal(self, ios: list[StreamIO], nbytes: int) -> str | None:
        relayed = any(io.relayed for io in ios)
        return self.relay_limits.refusal(nbytes) if relayed else None

    async def _push_stream(self, peer: PeerID, io: StreamIO, plan: SendPlan, stream: int) -> None:
        writer = asyncio.create_task(send_stream_frames(io, plan, stream, self._executor))
        status = asyncio.create_task(io.read_status())
        try:
            await asyncio.wait({writer, status}, return_when=asyncio.FIRST_COMPLETED)
            if not writer.done() or writer.exception() is not None:
                # The peer answered before it had all our frames, or our writing broke (usually
                # because the peer refused and closed the stream): its status, if any, says why.
                await asyncio.wait({status}, timeout=2.0)
                if status.done() and status.exception() is None:
                    reason, detail = status.result()
                    self._raise_remote(peer, plan, Reason.MALFORMED if reason == Reason.OK else reason,
                                       detail or "the peer answered before receiving the whole message")
                if writer.done():
                    writer.result()
                if status.done():
                    status.result()
                raise TransferFailed(f"peer {peer} stopped reading our {plan.kind!r} message.")
            reason, detail = await status
            if reason != Reason.OK:
                self._raise_remote(peer, plan, reason, detail)
        finally:
            writer.cancel()
            status.cancel()
            await asyncio.wait({writer, status})

    async def _swap_stream(self, peer: PeerID, io: StreamIO, plan: SendPlan, stream: int, reply: "_ReplyState",
                           accept_round: RoundPredicate | None, accept_bytes: SizePredicate | None) -> None:
        stop = asyncio.Event()
        writer = asyncio.create_task(send_stream_frames(io, plan, stream, self._executor, stop))
        peer_bytes = peer.to_bytes()
        check = lambda raw, sig: self._check_reply_head(  # noqa: E731
            raw, sig, peer_bytes, plan, accept_round, accept_bytes)
        try:
            try:
                raw, signature = await io.read_frame_head(self.wire_limits.max_header_bytes)
                header = check(raw, signature)
                assembly = reply.join(self, peer, header)
                if assembly.attach_stream(header) != stream:
                    raise Refusal(Reason.MALFORMED, "reply frames arrived on another stream than they belong to")
                await BoundWork(assembly, self._receive_frames(io, assembly, stream, header, check))
                await assembly.complete
            except PeerStatus as status:  # the peer refused our message instead of replying
                self._raise_remote(peer, plan, Reason.MALFORMED if status.reason == Reason.OK else status.reason,
                                   status.detail or "the peer answered before replying")
            except Refusal as refusal:  # the reply failed our checks: tell the peer, at a frame boundary
                if reply.assembly is None or reply.assembly.fail(refusal):
                    self.counters.count_refusal_issued(refusal.reason, peer.to_base58(), refusal.congested)
                stop.set()
                await asyncio.wait({writer}, timeout=self.limits.stall_s)
                if writer.done() and not writer.cancelled() and writer.exception() is None and not io.frame_open:
                    with suppress(Exception):
                        await io.write_status(refusal.reason, refusal.detail)
                    await io.linger()
                raise ReplyRejected(peer.to_base58(), plan.kind, refusal.reason, refusal.detail) from None
            await writer  # our frames are all out; a status may follow them
            await io.write_status(Reason.OK)
            reason, detail = await io.read_status()
            if reason != Reason.OK:
                self._raise_remote(peer, plan, reason, detail)
        finally:
            writer.cancel()
            await asyncio.wait({writer})

    def _raise_remote(self, peer: PeerID, plan: SendPlan, reason: Reason, detail: str):
        self.counters.count_refusal_received(reason)
        raise RemoteRefused(peer.to_base58(), plan.kind, reason, detail)

    def _check_reply_head(self, raw: bytes, signature: bytes, peer: bytes, plan: SendPlan,
                          accept_round: RoundPredicate | None,
                          accept_bytes: SizePredicate | None = None) -> MessageHeader:
        header = check_head(raw, signature, peer, self._expect, time.time())
        if header.mode != Mode.REPLY or header.reply_to != plan.nonce:
            raise Refusal(Reason.MALFORMED, "the reply does not answer our message")
        if header.kind != plan.kind or header.streams != plan.streams:
            raise Refusal(Reason.MALFORMED, "the reply's kind or stream count differs from our message's")
        if accept_round is not None and not accept_round(header.round):
            raise Refusal(Reason.STALE_ROUND, f"reply round {header.round} is not acceptable")
        _check_size(header, accept_bytes)
        self._remember(header)
        return header

    # ------------------------------------------------------------------ serving a peer

class _ReplyState:
    """The reply assembly of one outgoing swap, created by the first reply frame that arrives;
    it shares the swap's progress (its size, from that frame, becomes what the swap receives)."""

    def __init__(self, progress: Progress):
        self.assembly: Assembly | None = None
        self.progress = progress

    def join(self, transport: Transport, peer: PeerID, header: MessageHeader) -> Assembly:
        if self.assembly is None:
            self.progress.expect(receiving=header.total)
            self.assembly = transport._new_assembly(peer, header, progress=self.progress)
        return self.assembly


async def _all_or_first_error(coroutines: list[Coroutine]) -> None:
    """Run all; on the first error cancel the rest and raise it."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
