"""The receiving half of `Transport` (p2p/streams.py): where an incoming message is verified.

Per stream `_serve` reads the signed head, checks it (wire.check_head: signature, swarm,
manifest, size bounds; the handler's round predicate; the declared size; the replay guard),
joins the streams of one message into one `Assembly` whose payload bytes are reserved per peer
and globally before any is read, reads the frames into one buffer while hashing, and answers
each stream with a status: OK, or the refusal's reason (counted, and a strike where the reason
is misbehaviour). A verified message is delivered to its handler (push), or the handler's reply
is sent back on the same streams (swap, request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass

from hivemind.p2p import PeerID

from p2p.assembly import Assembly, BoundWork
from p2p.errors import LimitsError, Reason, Refusal
from p2p.forwarding import blamed, read_preamble
from p2p.framing import PeerStatus, StreamIO
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.progress import Progress
from p2p.sending import SendPlan, send_stream_frames
from p2p.wire import MessageHeader, Mode, check_head

logger = logging.getLogger("lowcomm.p2p.streams")
STREAM_PROTOCOL = "/lowcomm/stream/1"
RoundPredicate = Callable[[int], bool]
# the payload bytes a message's header declares, checked before any of it is read: a kind whose
# size the receiver knows (a NoLoCo snapshot: exactly its own) refuses any other size at once
SizePredicate = Callable[[int], bool]
HeadCheck = Callable[[bytes, bytes], MessageHeader]


@dataclass(frozen=True)
class _Handler:
    mode: int
    accept_round: RoundPredicate
    deliver: Callable[[ReceivedMessage], Awaitable[None]] | None
    reply: Callable[[MessageHeader], Awaitable[OutgoingMessage]] | None
    accept_bytes: SizePredicate | None = None
    check_head: Callable[[MessageHeader], None] | None = None  # raises Refusal: refused unread
    finished: Callable[[MessageHeader], None] | None = None  # a request's exchange is over


def _check_size(header: MessageHeader, accept_bytes: SizePredicate | None) -> None:
    """Refuses, before any payload is read, a message whose declared size its kind rules out."""
    if accept_bytes is not None and not accept_bytes(header.total):
        raise Refusal(Reason.TOO_LARGE, f"a {header.kind!r} message declaring {header.total} payload "
                                        "bytes is not the size this swarm's manifest gives it; send "
                                        "what the manifest says")


def _short(peer: PeerID) -> str:
    return peer.to_base58()[-8:]


class _ForwardedInfo:
    """What `_serve` reads of a stream's info, for a forwarded stream: the origin, no address."""

    def __init__(self, origin: PeerID):
        self.peer_id, self.addr = origin, None


class IncomingStreams:
    """Transport's serving side; the state it reads (handlers, limits, ledger, counters, replay
    guard, bans) is Transport's own, set in Transport.__init__."""

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                     forwarder: PeerID | None = None) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        peer: PeerID = info.peer_id
        peer_bytes = peer.to_bytes()
        io = StreamIO(reader, writer, self.counters, self.limits.stall_s, self._executor)
        if forwarder is None:
            relayed = self.counters.paths.note(peer.to_base58(), info.addr)
        else:
            relayed = False
            self.counters.paths.note_forwarded(peer.to_base58())
        assembly: Assembly | None = None
        bound: list[BoundWork] = []
        opened = repeated = verified = False
        try:
            if self.admit is not None and not self.admit(peer.to_base58()):
                raise Refusal(Reason.NOT_ADMITTED, "this swarm admits only the keys on its "
                              "allowlist, and yours is not on it")
            if self._bans.get(peer_bytes, 0.0) > time.monotonic():
                raise Refusal(Reason.BANNED, "this node has banned you for a while")
            if not self._ledger.try_open_stream(peer_bytes):
                raise Refusal(Reason.BUSY, f"more than {self.limits.max_streams_per_peer} streams from you")
            opened = True
            raw, signature = await io.read_frame_head(self.wire_limits.max_header_bytes)
            header = check_head(raw, signature, peer_bytes, self._expect, time.time())
            verified = True
            if self.on_heard is not None:
                self.on_heard(peer.to_base58())
            earlier = self._refused.earlier(peer_bytes, header.nonce)
            if earlier is not None:  # another stream of a message refused already: counted once
                repeated = True
                raise earlier
            try:
                handler = self._check_request(header)
                assembly, stream = self._join_incoming(peer, header, handler, forwarder)
            except Refusal as refusal:
                self._refused.remember(peer_bytes, header.nonce, header.streams, refusal)
                raise
            io.progress = assembly.progress  # from here the message's streams progress together
            check = lambda raw, sig: self._check_request_head(raw, sig, peer_bytes)[0]  # noqa: E731
            bound.append(BoundWork(assembly, self._receive_frames(io, assembly, stream, header, check)))
            if header.mode == Mode.SWAP:
                plan: SendPlan = await assembly.reply
                assembly.progress.expect(sending=plan.message.total_bytes)
                refusal = relayed and self.relay_limits.refusal(plan.message.total_bytes)
                if refusal:
                    raise Refusal(Reason.TOO_LARGE, f"our reply was not sent: {refusal}")
                # Our half goes out while the peer's half comes in (the reader runs meanwhile).
                bound.append(BoundWork(assembly, send_stream_frames(io, plan, stream, self._executor)))
                await bound[-1]
            await bound[0]
            await assembly.complete
            reason, detail = await assembly.outcome
            await io.write_status(reason, detail)
            if header.mode == Mode.SWAP:
                their_reason, their_detail = await io.read_status()
                if their_reason != Reason.OK:
                    self.counters.count_refusal_received(their_reason)
                    logger.info("peer %s rejected our %r reply: %s (%s)", _short(peer), header.kind,
                                their_reason.name, their_detail)
                elif stream == 0:
                    self.counters.messages_sent += 1
        except Refusal as refusal:
            if not repeated and (assembly is None or assembly.fail(refusal)):
                blame = blamed(refusal.reason, peer, forwarder, verified)
                self.counters.count_refusal_issued(refusal.reason, blame.to_base58(), refusal.congested)
                logger.info("refused a stream from %s%s: %s (%s)", _short(peer),
                            f" forwarded by {_short(forwarder)}" if forwarder else "", refusal.reason.name,
                            refusal.detail)
            if not io.frame_open:
                with suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await io.write_status(refusal.reason, refusal.detail)
                # This stream's frame reader may still be waiting on the stream (the assembly's
                # failure only asked it to stop): lingering beside it would fail at once, close
                # with the peer's bytes unread and reset the stream over our status.
                await _stopped(bound)
                await io.linger()
        except PeerStatus as status:  # the peer gave up mid-message (e.g. it rejected our reply)
            self.counters.count_refusal_received(status.reason)
            logger.info("peer %s stopped its message: %s (%s)", _short(peer), status.reason.name, status.detail)
            if assembly is not None:
                assembly.fail(Refusal(Reason.REFUSED, f"peer aborted: {status.reason.name}"))
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            if assembly is not None:
                assembly.fail(Refusal(Reason.TRUNCATED, f"stream broke: {type(error).__name__}"))
        except asyncio.CancelledError:
            if assembly is not None:
                assembly.fail(Refusal(Reason.BUSY, "the node is shutting down"))
        except Exception:
            logger.exception("internal error while serving a stream from %s", _short(peer))
            if assembly is not None:
                assembly.fail(Refusal(Reason.INTERNAL, "the receiver failed"))
        finally:
            await _stopped(bound)
            if opened:
                self._ledger.close_stream(peer_bytes)
            io.close()
            if assembly is not None:
                assembly.stream_ended()
            self._tasks.discard(task)

    async def _serve_forwarded(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A stream a member forwards to us from the peer its preamble names: served as that
        peer's, its frames checked against that peer's key; what a forwarder could have caused
        counts against the forwarder (p2p/forwarding.py `blamed`)."""
        forwarder: PeerID = info.peer_id
        try:
            if self.admit is not None and not self.admit(forwarder.to_base58()):
                raise Refusal(Reason.NOT_ADMITTED, "only members of this swarm may forward to it")
            if self._bans.get(forwarder.to_bytes(), 0.0) > time.monotonic():
                raise Refusal(Reason.BANNED, "this node has banned you for a while")
            origin = await read_preamble(reader, self.limits.stall_s)
        except Refusal as refusal:
            self.counters.count_refusal_issued(refusal.reason, forwarder.to_base58(), refusal.congested)
            logger.info("refused a forwarded stream from %s: %s (%s)", forwarder.to_base58()[-8:],
                        refusal.reason.name, refusal.detail)
            writer.close()
            return
        await self._serve(_ForwardedInfo(origin), reader, writer, forwarder=forwarder)

    def _check_request_head(self, raw: bytes, signature: bytes, peer: bytes) -> tuple[MessageHeader, _Handler]:
        header = check_head(raw, signature, peer, self._expect, time.time())
        return header, self._check_request(header)

    def _check_request(self, header: MessageHeader) -> _Handler:
        """The handler of a checked header, after the checks that need this node's state."""
        handler = self._handlers.get((header.kind, header.mode))
        if handler is None:
            raise Refusal(Reason.UNSUPPORTED, f"this node does not accept {Mode.NAMES[header.mode]} "
                                              f"messages of kind {header.kind!r}")
        if not handler.accept_round(header.round):
            raise Refusal(Reason.STALE_ROUND, f"round {header.round} is not acceptable here")
        _check_size(header, handler.accept_bytes)
        if handler.check_head is not None:
            handler.check_head(header)
        self._remember(header)
        return handler

    def _remember(self, header: MessageHeader) -> None:
        verdict = self._replay.check_and_remember(header.sender, header.nonce, header.frame, time.time())
        if verdict == "replayed":
            raise Refusal(Reason.REPLAYED, f"frame {header.frame} of this message was already received")
        if verdict == "full":
            raise Refusal(Reason.BUSY, "too many recent messages from you")

    def _join_incoming(self, peer: PeerID, header: MessageHeader, handler: _Handler,
                       forwarder: PeerID | None = None) -> tuple[Assembly, int]:
        key = (peer.to_bytes(), header.nonce)
        assembly = self._assemblies.get(key)
        if assembly is None:
            # a message left incomplete is a stall its forwarder could have caused
            assembly = self._new_assembly(peer, header,
                                          on_expired=lambda refusal: self._expired(forwarder or peer, refusal))
            self._assemblies[key] = assembly
            assembly.complete.add_done_callback(lambda _: self._assemblies.pop(key, None))
            self.counters.messages_received += 1
            if handler.finished is not None:
                assembly.on_finished = lambda: handler.finished(header)
            if header.mode == Mode.SWAP:
                self._spawn(assembly, self._produce_reply(assembly, handler))
            self._spawn(assembly, self._deliver(assembly, handler))
        try:
            stream = assembly.attach_stream(header)
        except Refusal as refusal:
            assembly.fail(refusal)
            raise
        assembly.stream_started()
        return assembly, stream

    def _expired(self, peer: PeerID, refusal: Refusal) -> None:
        """An incoming message its streams left incomplete, stalled or too slow to finish in time
        (p2p/progress.py): a refusal like any other (the fuzzer found these went uncounted, so a
        staller was never struck)."""
        self.counters.count_refusal_issued(refusal.reason, peer.to_base58(), refusal.congested)
        logger.info("refused a message from %s: %s (%s)", _short(peer), refusal.reason.name, refusal.detail)

    def _new_assembly(self, peer: PeerID, header: MessageHeader,
                      on_expired: Callable[[Refusal], None] | None = None,
                      progress: Progress | None = None) -> Assembly:
        """The assembly of a message whose header checked, its bytes reserved. `progress`: the
        exchange's (a reply's: the swap we asked for); else its own, whose default need-by covers
        every payload this node is receiving now at the swarm's minimum link rate (they share our
        downlink, so this one may wait for the others), and our reply to it once known."""
        if header.tensors is None:
            raise Refusal(Reason.MALFORMED, "the first frame of a stream must carry the tensor manifest")
        peer_bytes, total = peer.to_bytes(), header.total
        if not self._ledger.try_reserve(peer_bytes, total):
            # Capacity, not misbehaviour: every size the swarm's manifest allows fits one message
            # (p2p/sizing.py); more at once from one peer, or from many, waits for room.
            raise Refusal(Reason.NO_ROOM, f"this node holds {self._ledger.reserved_bytes(peer_bytes)} "
                                          f"bytes of your messages and {self._ledger.total_bytes} in all, "
                                          f"and cannot take {total} more now; try again later")
        if progress is None:
            progress = Progress(self.limits, receiving=total, sharing=self._ledger.total_bytes,
                                counters=self.counters)
        return Assembly(peer, header, progress, lambda: self._ledger.release(peer_bytes, total), on_expired)

    def _spawn(self, assembly: Assembly, coroutine: Coroutine) -> None:
        task = asyncio.create_task(coroutine)
        assembly.side_tasks.add(task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce_reply(self, assembly: Assembly, handler: _Handler) -> None:
        first = assembly.first
        try:
            async with asyncio.timeout(self.limits.reply_timeout_s):
                message = await handler.reply(first)
            if not isinstance(message, OutgoingMessage) or message.kind != first.kind:
                raise TypeError(f"the reply handler for {first.kind!r} must return an OutgoingMessage "
                                f"of the same kind")
            plan = SendPlan(self.identity, swarm=self.swarm, manifest=self.manifest, recipient=first.sender,
                            message=message, mode=Mode.REPLY, streams=first.streams, limits=self.limits,
                            wire=self.wire_limits, reply_to=first.nonce)
            if not assembly.reply.done():
                assembly.reply.set_result(plan)
        except Refusal as refusal:
            _refuse_reply(assembly, refusal)
        except LimitsError as error:  # our reply exceeds what peers accept: a refusal, said once
            logger.warning("did not answer %s's %r request: %s", _short(assembly.sender), first.kind, error)
            _refuse_reply(assembly, Refusal(Reason.REFUSED, str(error)))
        except TimeoutError:
            _refuse_reply(assembly, Refusal(Reason.TIMEOUT, "no reply was ready in time"))
        except Exception:
            logger.exception("the reply handler for %r failed", first.kind)
            _refuse_reply(assembly, Refusal(Reason.INTERNAL, "the reply handler failed"))

    async def _deliver(self, assembly: Assembly, handler: _Handler) -> None:
        with suppress(Refusal):
            message = await assembly.complete
            self.counters.messages_verified += 1
            outcome = (Reason.OK, "")
            try:
                if handler.deliver is not None:
                    async with asyncio.timeout(self.limits.reply_timeout_s):
                        await handler.deliver(message)
            except Refusal as refusal:
                outcome = (refusal.reason, refusal.detail)
                self.counters.count_refusal_issued(refusal.reason, message.sender.to_base58(), refusal.congested)
            except TimeoutError:
                outcome = (Reason.TIMEOUT, "the receiver's handler took too long")
            except Exception:
                logger.exception("the delivery handler for %r failed", message.kind)
                outcome = (Reason.INTERNAL, "the receiver's handler failed")
            if not assembly.outcome.done():
                assembly.outcome.set_result(outcome)

    async def _receive_frames(self, io: StreamIO, assembly: Assembly, stream: int, header: MessageHeader,
                              check: HeadCheck) -> None:
        """Read this stream's frames into the assembly, checking each header and digest.

        A frame's digest is settled after the next frame's payload is read: its last bytes are
        hashed in a thread meanwhile, so the stream never idles waiting for a hash.
        """
        previous: asyncio.Future | None = None
        while True:
            verification = await io.read_payload_into(assembly.destination(stream, header), header.digest)
            if previous is not None:
                await self._settle(assembly, previous)
            previous = verification
            if header.frame + header.streams >= header.frames:   # this stream's last frame
                await self._settle(assembly, previous)
                return
            raw, signature = await io.read_frame_head(self.wire_limits.max_header_bytes)
            header = check(raw, signature)

    async def _settle(self, assembly: Assembly, verification: asyncio.Future) -> None:
        await verification
        self.counters.frames_received += 1
        assembly.frame_done()


def _refuse_reply(assembly: Assembly, refusal: Refusal) -> None:
    """Our reply is refused: the message fails, or, when the asking half (a request's: empty)
    completed before the handler gave up, the reply it waits on does, so that the refusal
    still reaches the asker (it waited for its deadline instead)."""
    if not assembly.fail(refusal) and not assembly.reply.done():
        assembly.reply.set_exception(refusal)


async def _stopped(works: list[BoundWork]) -> None:
    """Cancel a stream's reading and writing and wait until they have let go of it."""
    for work in works:
        await work.stop()
