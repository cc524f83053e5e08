"""Bringing back a member whose φ left the majority's by replaying its steps, the event loop's
side (docs/protocols.md §3: "a node that missed messages rejoins the agreed state without stalling
the others").

A φ splits when a member's outer step applied another set of messages than the majority's (a
push that broke, a message that came after the member closed the round), and every later step
builds on the split. Every member records, for each of its last REPLAY_ROUNDS steps, the round
the step applied and the senders of the messages it took (`record`), and serves those records
to any member that asks (APPLIED: a few hundred bytes). A member whose consensus check finds
its φ of round k off the majority's asks a holder of the majority's φ for its records of the
steps since a, the last round whose φ this member knows was agreed, takes the messages it lacks
from the relay's store or fetches them from members (relay.py: each copy checked against its
author's signature), and hands the training thread a recipe: each step's senders, the copies,
and the majority's digest of round k. The training thread replays those steps from its agreed
state of round a (node/rounds/dilocox/round.py `_replayed`) and keeps the result only if its
digest is the majority's. Where a resync downloads φ and the outer momentum whole (8 bytes a
parameter), a replay moves the compressed messages the member missed.

Invariants:
- a holder's records are a claim, not a proof: the replayed φ must have the majority's digest
  or the recipe is dropped; a record strikes no one (a member whose step was replaced by a
  resync holds no record of it, and refuses the request);
- a reply is bounded before its messages are fetched: one record for each round asked, at most
  twice as many senders as the members and us (senders may have left since), each a peer id,
  none twice;
- records are kept for REPLAY_ROUNDS rounds (link.py), as the relay keeps messages: a replay
  needs both; a member agreed longer ago than that downloads the state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from node.events import ReplayReady
from node.rounds.dilocox.link import REPLAY_ROUNDS, Replay, Step
from node.rounds.dilocox.relay import Relay
from node.rounds.swarm import Swarm, failure_sentence
from p2p.errors import P2PError, Reason, Refusal
from p2p.messages import OutgoingMessage, OutgoingTensor, ReceivedMessage

log = logging.getLogger("lowcomm.dilocox")
APPLIED = "dilocox.applied"
RECORDS = "records"  # the reply's one tensor: "round target sender sender ..." lines, UTF-8
MAX_PEER_ID_CHARS = 128

class StepReplay:
    """Records our steps' senders, serves them, and builds the recipe of a replay."""

    def __init__(self, swarm: Swarm, relay: Relay, members: Callable[[], list[str]]):
        """`members()`: the live members on our manifest (bounds a reply's senders)."""
        self.swarm, self.relay, self.members = swarm, relay, members
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
        for old in [r for r in self.applied if r <= round_index - REPLAY_ROUNDS]:
            del self.applied[old]

    async def _respond(self, header) -> OutgoingMessage:
        since = header.meta.get("since")
        wanted = range(since + 1, header.round + 1) if type(since) is int else range(0)
        if not 0 < len(wanted) <= REPLAY_ROUNDS or any(r not in self.applied for r in wanted):
            raise Refusal(Reason.REFUSED, f"no record of every step after round {since} to round "
                          f"{header.round} here")
        lines = [" ".join([str(r), str(self.applied[r][0]), *self.applied[r][1]]) for r in wanted]
        data = bytearray("\n".join(lines).encode())
        return OutgoingMessage(APPLIED, header.round,
                               [OutgoingTensor(RECORDS, "uint8", (len(data),), data)], {"since": since})

    async def recipe(self, round_index: int, since: int, digest: str, holders: list[str]
                     ) -> Replay | None:
        """What replays our steps after round `since` (our φ of it was agreed) to the majority's
        φ of `round_index` (`digest`, held by `holders`); None beyond the REPLAY_ROUNDS steps
        records and messages are kept for, when no holder answered or a message could not be
        had."""
        if not since < round_index <= since + REPLAY_ROUNDS:
            return None
        for holder in holders:
            try:
                reply = await self.transport.request(holder, APPLIED, round_index,
                                                     meta={"since": since}, streams=1)
                steps = self._read(round_index, since, reply)
            except (P2PError, ValueError) as exc:
                log.info("round %d: no records of its steps from %s (%s)", round_index,
                         holder[-8:], failure_sentence(exc) if isinstance(exc, P2PError) else exc)
                continue
            copies: dict[tuple[int, str], ReceivedMessage] = {}
            fetched = 0
            for _, target, senders in steps:
                got = await self._copies(target, senders, holders)
                if got is None:
                    return None
                for author, (copy, was_fetched) in got.items():
                    copies[(target, author)] = copy
                    fetched += was_fetched
            self.swarm.publish(ReplayReady(
                round=round_index, source=holder, steps=len(steps),
                senders=sum(len(s) for _, _, s in steps), fetched=fetched,
                bytes=sum(len(c.payload) for c in copies.values())))
            return Replay(since, round_index, steps, copies, digest, holder)
        return None

    def _read(self, round_index: int, since: int, reply: ReceivedMessage) -> list[Step]:
        """The records in a reply, or ValueError saying what is wrong with them."""
        views = reply.tensor_views()
        if reply.round != round_index or set(views) != {RECORDS}:
            raise ValueError(f"its reply does not hold the records up to round {round_index}")
        lines = bytes(views[RECORDS][1]).decode("utf-8", errors="strict").split("\n")
        if len(lines) != round_index - since:
            raise ValueError(f"its reply holds {len(lines)} records where the rounds after {since} "
                             f"to {round_index} are {round_index - since}")
        bound = 2 * (len(self.members()) + 1)  # the members and us, twice: senders may have left
        steps: list[Step] = []
        for expected, line in zip(range(since + 1, round_index + 1), lines, strict=True):
            fields = line.split(" ")  # a step with nothing due applied round -1, no one
            if len(fields) < 2 or fields[0] != str(expected) or not fields[1].lstrip("-").isdigit() \
                    or not -1 <= int(fields[1]) <= expected or (int(fields[1]) < 0 and fields[2:]):
                raise ValueError(f"its record of round {expected} is malformed")
            senders = tuple(fields[2:])
            if len(senders) > bound or len(set(senders)) != len(senders) \
                    or any(not s or len(s) > MAX_PEER_ID_CHARS for s in senders):
                raise ValueError(f"its record of round {expected} names {len(senders)} senders (at "
                                 f"most {bound} distinct peer ids can have sent)")
            steps.append((expected, int(fields[1]), senders))
        return steps

    async def _copies(self, target: int, senders: tuple[str, ...], holders: list[str]
                      ) -> dict[str, tuple[ReceivedMessage, bool]] | None:
        """Every sender's message of round `target` but ours, with whether it was fetched: from
        the relay's store, or fetched from the holders and then the other members (the author
        last: relay.py), and kept there in turn."""
        own = self.swarm.peer_id
        copies = {a: (m, False) for a in senders if a != own and (m := self.relay.store.get(target, a))}
        missing = [a for a in senders if a != own and a not in copies]

        async def fetch(author: str) -> None:
            order = [h for h in holders if h != author]
            order += [m for m in self.members() if m not in order and m != author] + [author]
            copy = await self.relay.fetch(target, author, order)
            # kept, ours to hand on and for a later recipe, unless its author equivocated
            if copy is not None and self.relay.accepted(author, copy):
                copies[author] = (copy, True)
        await asyncio.gather(*(fetch(a) for a in missing))
        if any(a not in copies for a in missing):
            log.info("round %d: the messages of %s to replay it could not be had", target,
                     ", ".join(a[-8:] for a in missing if a not in copies))
            return None
        return copies
