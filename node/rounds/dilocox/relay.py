"""Handing DiLoCoX messages on: every member keeps the messages it accepted for a few rounds and
gives one to any member that asks; a member missing the message of an author that finished the
round asks the others for it (docs/protocols.md §3, "relaying signed messages").

What it mends: a push that broke, a push to a member the author's view did not list yet, and a
swarm larger than the fan-out, where each message goes to a random subset of the members: the
others fetch it from that subset, so every member applies the same messages and φ does not
split by design.

The author signs each message once for every receiver (p2p/origin.py) and a relayed copy is
checked against the author's key before it joins the inbox, so a relay can withhold a message
but neither forge nor alter one; a copy that fails the check bans the relay that served it.

Invariants:
- we ask only for an author that finished the round (its message exists) and only while nothing
  of that message is arriving from it (`Transport.receiving`): a push on its way would come twice;
- we ask once the message has been missing `ASK_AFTER_S` (a push the author started as it
  announced the round's end is arriving by then on a link that carries the round at all),
  during the round after it (the exchange looks every WATCH_S), so that the copy is here at the
  round's end; one holder at a time; a failed round of asking is repeated `ASK_AFTER_S` later;
- the store keeps what it accepted of the last REPLAY_ROUNDS rounds (a diverged member may
  replay as many steps, and lack their messages), and our own signed messages as we sent them
  (`keep_own`), at most `KEEP_BYTES`; a fetch asks the author last (exchange.py, replay.py):
  members that hold a copy first, so that the asking spreads and outlives the author leaving.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from node.events import Relayed
from node.rounds.swarm import Swarm, failure_sentence
from p2p.errors import P2PError, Reason, Refusal
from p2p.messages import OutgoingMessage, OutgoingTensor, ReceivedMessage
from p2p.origin import ORIGIN, ORIGIN_DIGEST, origin_holds, sign_origin
from p2p.wire import TensorEntry

log = logging.getLogger("lowcomm.dilocox")
RELAY = "dilocox.relay"
AUTHOR = "author"  # the request's and the reply's meta: whose message
ASK_AFTER_S = 0.5
KEEP_BYTES = 256 << 20


class MessageStore:
    """The messages this node accepted, by (round, author): the last rounds, bounded in bytes."""

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes, self.bytes = keep_bytes, 0
        self.messages: OrderedDict[tuple[int, str], ReceivedMessage] = OrderedDict()

    def keep(self, round_index: int, author: str, message: ReceivedMessage) -> None:
        if (round_index, author) in self.messages:
            return
        self.messages[(round_index, author)] = message
        self.bytes += len(message.payload)
        while self.bytes > self.keep_bytes and self.messages:
            _, dropped = self.messages.popitem(last=False)
            self.bytes -= len(dropped.payload)

    def get(self, round_index: int, author: str) -> ReceivedMessage | None:
        return self.messages.get((round_index, author))

    def forget_before(self, round_index: int) -> None:
        for key in [k for k in self.messages if k[0] < round_index]:
            self.bytes -= len(self.messages.pop(key).payload)

    def drop(self, author: str) -> None:
        """Forgets every message of `author` (proven to equivocate: evidence.py)."""
        for key in [k for k in self.messages if k[1] == author]:
            self.bytes -= len(self.messages.pop(key).payload)


@dataclass(frozen=True)
class OwnCopy:
    """Our own signed message as the store serves it: the fields a received copy holds."""
    round: int
    meta: dict
    tensors: tuple[TensorEntry, ...]
    payload: memoryview
    tensor_views = ReceivedMessage.tensor_views


@dataclass
class Wanted:
    """A message we lack: missing since `since` (or since our last ask of it failed), and the
    ask in flight, if any."""
    since: float
    task: asyncio.Task | None = None

    @property
    def asking(self) -> bool:
        return self.task is not None and not self.task.done()


class Relay:
    """Signs our messages, checks and keeps those we accept, serves and fetches copies."""

    def __init__(self, swarm: Swarm, kind: str,
                 witness: Callable[[str, ReceivedMessage], bool], clock: Callable[[], float]):
        """`witness(author, message)`: False for a checked message that must not be kept, a
        second version of its author's message of the round (evidence.py `accepted`)."""
        self.swarm, self.kind, self.witness, self.clock = swarm, kind, witness, clock
        self.transport = swarm.transport
        self.store = MessageStore()
        self._wanted: dict[tuple[int, str], Wanted] = {}  # (round, author) -> our asking for it

    def start(self) -> None:
        self.transport.on_request(RELAY, self.transport.counters.counted_reply(self._respond),
                                  accept_round=lambda r: True)

    # ------------------------------------------------------------------ our messages and theirs
    def sign(self, message: OutgoingMessage) -> None:
        """Puts our origin signature in `message`'s meta (hashes its payload: any thread)."""
        sign_origin(self.transport.identity, self.transport.swarm, self.transport.manifest, message)

    def keep_own(self, message: OutgoingMessage) -> None:
        """Keeps our signed `message` (loop side) to serve a member that asks us for it."""
        self.store.keep(message.round, self.swarm.peer_id, OwnCopy(
            message.round, message.meta, message.manifest(), memoryview(b"".join(message.segments()))))

    def authored_by(self, author: str, message: ReceivedMessage) -> bool:
        return origin_holds(author, self.transport.swarm, self.transport.manifest, self.kind,
                            message)

    def accepted(self, author: str, message: ReceivedMessage) -> bool:
        """Keeps a message whose origin signature we checked, unless `witness` refuses it:
        then False, and it must not be used."""
        if not self.witness(author, message):
            return False
        self.store.keep(message.round, author, message)
        return True

    # ------------------------------------------------------------------ serving
    async def _respond(self, header) -> OutgoingMessage:
        author = header.meta.get(AUTHOR)
        message = self.store.get(header.round, author) if isinstance(author, str) else None
        if message is None:
            raise Refusal(Reason.REFUSED, f"no message of round {header.round} from that author here")
        tensors = [OutgoingTensor(entry.name, entry.dtype, entry.shape, view)
                   for entry, view in message.tensor_views().values()]
        return OutgoingMessage(RELAY, header.round, tensors,
                               {AUTHOR: author, ORIGIN: message.meta[ORIGIN],
                                ORIGIN_DIGEST: message.meta[ORIGIN_DIGEST]})

    # ------------------------------------------------------------------ asking
    def ask(self, round_index: int, authors: Iterable[str], holders: Callable[[str], list[str]],
            deliver: Callable[[str, ReceivedMessage], None]) -> None:
        """Called again and again (every WATCH_S, and while a collect waits) with the `authors`
        that finished `round_index` and whose message we lack: starts fetching the message of
        each that has been missing ASK_AFTER_S, is not arriving and is not being fetched;
        `holders(author)`: whom to ask, in order; `deliver(author, message)` takes a checked
        copy."""
        now = self.clock()
        for author in authors:
            key = (round_index, author)
            wanted = self._wanted.get(key)
            if wanted is not None and wanted.asking:
                continue
            if self.transport.receiving(author, self.kind, round_index):
                self._wanted.pop(key, None)
                continue
            if wanted is None:
                self._wanted[key] = wanted = Wanted(since=now)
            if now - wanted.since < ASK_AFTER_S:
                continue
            wanted.since = now  # a failed round of asking is repeated this much later
            wanted.task = self.swarm.tasks.spawn(
                self._fetch(round_index, author, holders(author), deliver),
                f"dilocox relay of round {round_index} from {author[-8:]}")

    def fetching(self, round_index: int) -> set[str]:
        """The authors whose message of `round_index` we are asking a holder for now."""
        return {author for (r, author), wanted in self._wanted.items() if r == round_index and wanted.asking}

    def stop_asking(self, round_index: int) -> None:
        """The round was collected: what is still being fetched of it (or before) is for no one."""
        for key in [k for k in self._wanted if k[0] <= round_index]:
            task = self._wanted.pop(key).task
            if task is not None:
                task.cancel()

    async def fetch(self, round_index: int, author: str, holders: list[str]) -> ReceivedMessage | None:
        """A checked copy of `author`'s message of `round_index` from the first of `holders`
        that serves one; None if none did (replay.py). Each fetch ends when done, stalled or
        unable to finish in time at the swarm's minimum link rate (p2p/progress.py); all of
        them when the round is collected (`forget`)."""
        got: list[ReceivedMessage] = []
        await self._fetch(round_index, author, holders, lambda _author, copy: got.append(copy))
        return got[0] if got else None

    async def _fetch(self, round_index: int, author: str, holders: list[str],
                     deliver: Callable[[str, ReceivedMessage], None]) -> None:
        for holder in holders:
            try:
                copy = await self.transport.request(
                    holder, RELAY, round_index, meta={AUTHOR: author},
                    streams=self.transport.limits.parallel_streams)
            except P2PError as exc:
                log.debug("round %d: %s has no copy of %s's message (%s)", round_index,
                          holder[-8:], author[-8:], failure_sentence(exc))
                continue
            if copy.meta.get(AUTHOR) != author or copy.round != round_index \
                    or not await self.swarm.loop.run_in_executor(None, self.authored_by, author, copy):
                # proof, not a symptom: we check every copy we keep, so an honest relay never
                # serves one that fails
                self.swarm.bans.ban_now(holder, "bad_relay", f"{holder} relayed a message of "
                                        f"round {round_index} that {author} did not sign",
                                        self.transport.ban)
                continue
            self.swarm.publish(Relayed(round=round_index, author=author, holder=holder,
                                       bytes=len(copy.payload)))
            deliver(author, copy)
            return
