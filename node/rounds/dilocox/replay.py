"""Bringing back a member whose φ left the majority's by replaying the step, the event loop's
side (PROTOCOLS.md §3: "a node that missed messages rejoins the agreed state without stalling
the others").

A φ splits when a member's outer step applied another set of messages than the majority's (a
push that broke, a message that came after the member closed the round). Every member records,
for each of its last steps, the round the step applied and the senders of the messages it took
(`record`), and serves that record to any member that asks (APPLIED: a few hundred bytes). A
member whose consensus check finds its φ of round r off the majority's asks a holder of the
majority's φ for its record of r, takes the messages it lacks from the relay's store or fetches
them from members (relay.py: each copy checked against its author's signature), and hands the
training thread a recipe: those senders, the copies, and the majority's digest. The training
thread replays the step from its own state before it (node/rounds/dilocox/round.py
`_replayed`) and keeps the result only if its digest is the majority's. Where a resync
downloads φ and the outer momentum whole (27 MB for the tiny model, 1 GB for `small`), a replay
moves the messages the member missed: kilobytes.

Invariants:
- a holder's record is a claim, not a proof: the replayed φ must have the majority's digest or
  the recipe is dropped, and the member downloads the state at its next divergent check; a
  record strikes no one (a member whose step was replaced by a resync holds no record of it);
- a reply is bounded before its messages are fetched: at most twice as many senders as the
  members and us (senders may have left since), each a peer id, none twice, for the round the
  request named;
- records are kept for the last KEEP_ROUNDS rounds, as the relay keeps messages: a replay
  needs both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from node.events import ReplayReady
from node.rounds.dilocox.relay import KEEP_ROUNDS, Relay
from node.rounds.swarm import Swarm, failure_sentence
from p2p.errors import P2PError, Reason, Refusal
from p2p.messages import OutgoingMessage, OutgoingTensor, ReceivedMessage

log = logging.getLogger("lowcomm.dilocox")
APPLIED = "dilocox.applied"
SENDERS = "senders"  # the reply's one tensor: the senders' peer ids, "\n"-separated, UTF-8
MAX_PEER_ID_CHARS = 128


class StepReplay:
    """Records our steps' senders, serves them, and builds the recipe of a replay."""

    def __init__(self, swarm: Swarm, relay: Relay, deadline_s: float,
                 members: Callable[[], list[str]]):
        """`members()`: the live members on our manifest (bounds a reply's senders)."""
        self.swarm, self.relay, self.deadline_s, self.members = swarm, relay, deadline_s, members
        self.transport = swarm.transport
        self.applied: dict[int, tuple[int, tuple[str, ...]]] = {}  # our round -> (its step's round, senders)

    def start(self) -> None:
        self.transport.on_request(APPLIED, self.transport.counters.counted_reply(self._respond),
                                  accept_round=lambda r: True)

    def record(self, round_index: int, applied: tuple[int, tuple[str, ...]] | None) -> None:
        """What the outer step of `round_index` applied; None: nothing we could vouch for (no
        step was due, or our φ of that round came whole from a resync)."""
        if applied is None:
            self.applied.pop(round_index, None)
        else:
            self.applied[round_index] = applied
        for old in [r for r in self.applied if r <= round_index - KEEP_ROUNDS]:
            del self.applied[old]

    async def _respond(self, header) -> OutgoingMessage:
        held = self.applied.get(header.round)
        if held is None:
            raise Refusal(Reason.REFUSED, f"no record of the messages round {header.round} applied here")
        target, senders = held
        data = bytearray("\n".join(senders).encode())
        return OutgoingMessage(APPLIED, header.round,
                               [OutgoingTensor(SENDERS, "uint8", (len(data),), data)],
                               {"applied_round": target})

    async def recipe(self, round_index: int, digest: str, holders: list[str]) -> dict | None:
        """What replays our step of `round_index` to the majority's φ (`digest`, held by
        `holders`): {"round", "target", "senders", "messages", "digest"}; None when no holder
        answered or a message could not be had."""
        for holder in holders:
            try:
                reply = await self.transport.request(holder, APPLIED, round_index, meta={},
                                                     timeout=self.deadline_s, streams=1)
                target, senders = self._read(round_index, reply)
            except (P2PError, ValueError) as exc:
                log.info("round %d: no record of its messages from %s (%s)", round_index,
                         holder[-8:], failure_sentence(exc) if isinstance(exc, P2PError) else exc)
                continue
            copies = await self._copies(target, senders, holders)
            if copies is None:
                return None
            fetched = [a for a in copies if self.relay.store.get(target, a) is None]
            for author in fetched:
                self.relay.accepted(author, copies[author])  # ours to hand on in turn
            self.swarm.publish(ReplayReady(round=round_index, source=holder, senders=len(senders),
                                           fetched=len(fetched),
                                           bytes=sum(len(copies[a].payload) for a in fetched)))
            return {"round": round_index, "target": target, "senders": senders,
                    "messages": copies, "digest": digest}
        return None

    def _read(self, round_index: int, reply: ReceivedMessage) -> tuple[int, tuple[str, ...]]:
        """The record in a reply, or ValueError saying what is wrong with it."""
        target = reply.meta.get("applied_round")
        views = reply.tensor_views()
        if reply.round != round_index or type(target) is not int or not 0 <= target <= round_index \
                or set(views) != {SENDERS}:
            raise ValueError(f"its reply does not hold one record of round {round_index}")
        text = bytes(views[SENDERS][1]).decode("utf-8", errors="strict")
        senders = tuple(text.split("\n")) if text else ()
        # the members and us, twice over: a sender may have left since its message was applied
        bound = 2 * (len(self.members()) + 1)
        if len(senders) > bound or len(set(senders)) != len(senders) \
                or any(not s or len(s) > MAX_PEER_ID_CHARS for s in senders):
            raise ValueError(f"its record names {len(senders)} senders (at most {bound} distinct "
                             f"peer ids can have sent)")
        return target, senders

    async def _copies(self, target: int, senders: tuple[str, ...], holders: list[str]
                      ) -> dict[str, ReceivedMessage] | None:
        """Every sender's message of round `target` but ours: from the relay's store, or fetched
        from the holders and then the other members (the author last: a member keeps what it
        received, not what it sent)."""
        own = self.swarm.peer_id
        copies = {a: m for a in senders if a != own and (m := self.relay.store.get(target, a))}
        missing = [a for a in senders if a != own and a not in copies]

        async def fetch(author: str) -> None:
            order = [h for h in holders if h != author]
            order += [m for m in self.members() if m not in order and m != author] + [author]
            copy = await self.relay.fetch(target, author, order)
            if copy is not None:
                copies[author] = copy
        await asyncio.gather(*(fetch(a) for a in missing))
        if any(a not in copies for a in missing):
            log.info("round %d: the messages of %s to replay it could not be had", target,
                     ", ".join(a[-8:] for a in missing if a not in copies))
            return None
        return copies
