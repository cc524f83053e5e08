"""Equivocation is proof: an author that signs two versions of its message of one round is
banned by every member that learns of it, and neither version is applied (docs/protocols.md §3).

The origin signature covers the message's content digest, which travels beside it in the
header (p2p/origin.py): a `Version` (author, round, digest, signature; about 130 bytes) is the
author's signed word on its message of a round, checked without the payload. Two versions of
one (author, round) with different digests, both signatures valid, are a `Proof` that no one but
the author can make, whoever delivers it.

Where versions meet:
- every message this node accepts (pushed by its author, relayed, fetched for a replay) and the
  header of a push of an (author, round) it already holds a version of (`check_push`);
- SEEN: at most every SEEN_EVERY_S a node tells each member the versions it accepted since it
  last did, headers only, one small message per round and member: two members that were sent
  different versions find out although neither was sent both;
- EVIDENCE: a proof (the two signed headers, no payload), pushed once to every member by each
  node as it learns of it, so that members that saw one version only ban too.

Checked like any message: a SEEN entry or an EVIDENCE whose signatures do not hold is refused
BAD_SIGNATURE, a strike against the member that sent it (an honest member reports only versions
it checked), so a forged proof bans no one. Memory is bounded: versions of the rounds the
relay keeps, at most MAX_VERSIONS; at most MAX_PROVEN proofs; a SEEN message holds at most two
entries for each member and us.

Invariant (one φ): a node never applies nor hands on a message of an author it holds proof
against; as it learns of one it drops that author's messages of the rounds it has not collected
and from its store. Every honest node that learns of the equivocation before it collects the
round leaves the author out of that round, so they all apply the same set. The proof reaches
every honest node about one SEEN_EVERY_S and two message latencies after two honest nodes hold
different versions; a round is collected a round after its messages are sent, so on a link that
carries the rounds at all it comes first. Limit: a node that collected the round before the
proof came applied one version; its φ of that round is then another than the others', and the
consensus check repairs it as any split (consensus.py), where the equivocator, banned, has no
vote and holds no φ that anyone adopts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np

from node.rounds.swarm import Swarm, failure_sentence, peer_name
from p2p.errors import P2PError, Reason, Refusal
from p2p.messages import OutgoingMessage, OutgoingTensor, ReceivedMessage
from p2p.origin import ORIGIN, ORIGIN_DIGEST, origin_signed
from p2p.wire import MessageHeader

log = logging.getLogger("lowcomm.dilocox")
SEEN = "dilocox.seen"
EVIDENCE = "dilocox.evidence"
SEEN_EVERY_S = 1.0
ENTRIES = "versions"  # SEEN's one tensor: msgpack [[author, digest, signature], ...]
ENTRY_BYTES = 256  # one entry's msgpack at most: a peer id of up to 128 characters, 32 + 64 bytes
MAX_VERSIONS = 1 << 14
MAX_PROVEN = 1024


@dataclass(frozen=True)
class Version:
    """`author`'s signed word on its message of `round`: the content `digest` and the origin
    `signature` over it (checked by `Equivocations.signed`)."""

    author: str
    round: int
    digest: bytes
    signature: bytes

    @classmethod
    def of(cls, author: str, round_index: int, meta: dict) -> Version | None:
        digest, signature = meta.get(ORIGIN_DIGEST), meta.get(ORIGIN)
        if isinstance(digest, bytes) and isinstance(signature, bytes):
            return cls(author, round_index, digest, signature)
        return None


@dataclass(frozen=True)
class Proof:
    """Two versions of one (author, round) with different digests."""

    first: Version
    second: Version

    @property
    def author(self) -> str:
        return self.first.author

    def meta(self) -> dict:
        return {"author": self.author, "digest": self.first.digest, "signature": self.first.signature,
                "digest2": self.second.digest, "signature2": self.second.signature}

    @classmethod
    def from_message(cls, message: ReceivedMessage) -> Proof:
        """ValueError when the message does not hold two versions of one author's message."""
        meta, author = message.meta, message.meta.get("author")
        first, second = (Version.of(author, message.round, {ORIGIN_DIGEST: meta.get("digest" + n),
                                                             ORIGIN: meta.get("signature" + n)})
                         for n in ("", "2"))
        if not isinstance(author, str) or first is None or second is None \
                or first.digest == second.digest:
            raise ValueError("it does not hold two versions of one author's message")
        return cls(first, second)


class Equivocations:
    """The versions this node saw, the proofs it holds, and the messages that carry them."""

    def __init__(self, swarm: Swarm, kind: str, *, members: Callable[[], list[str]],
                 check_round: Callable[[str, int], None], on_proof: Callable[[Proof], None],
                 clock: Callable[[], float]):
        """`kind`: the messages whose versions are compared; `members()`: whom SEEN and EVIDENCE
        go to; `check_round(sender, round)`: raises Refusal for a round no member may name;
        `on_proof(proof)`: drops the author's messages and bans it (the exchange)."""
        self.swarm, self.kind, self.members = swarm, kind, members
        self.check_round, self.on_proof, self.clock = check_round, on_proof, clock
        self.transport = swarm.transport
        self.versions: OrderedDict[tuple[int, str], Version] = OrderedDict()
        self.proven: OrderedDict[str, Proof] = OrderedDict()
        self._unreported: dict[int, list[Version]] = {}  # by round: accepted, not yet in a SEEN
        self._reported_at = -SEEN_EVERY_S

    def start(self) -> None:
        self.transport.on_push(SEEN, self._on_seen, accept_round=lambda r: True,
                               accept_bytes=lambda n: n <= self._max_entries() * ENTRY_BYTES,
                               check_head=lambda h: self.check_round(peer_name(h.sender), h.round))
        self.transport.on_push(EVIDENCE, self._on_evidence, accept_round=lambda r: True,
                               accept_bytes=lambda n: n == 0)

    def signed(self, version: Version) -> bool:
        return origin_signed(version.author, self.transport.swarm, self.transport.manifest,
                             self.kind, version.round, version.digest, version.signature)

    def _max_entries(self) -> int:
        return 2 * (len(self.members()) + 1)  # the members and us, twice: senders may have left

    # ------------------------------------------------------------------ versions we meet
    def accepted(self, author: str, message: ReceivedMessage) -> bool:
        """A message whose origin signature we checked: False (and drop it) when its author is
        proven to equivocate, or this is a second version (then that is proof)."""
        version = Version.of(author, message.round, message.meta)
        if version is None or not self._see(version):
            return False
        self._unreported.setdefault(version.round, []).append(version)
        return True

    def check_push(self, author: str, header: MessageHeader) -> None:
        """Before a push's payload is read: refused BANNED when its author is proven to
        equivocate, or when its header carries a second signed version of one we hold."""
        held = self.versions.get((header.round, author))
        version = Version.of(author, header.round, header.meta)
        if held is not None and version is not None and version.digest != held.digest \
                and self.signed(version):
            self._see(version)
        if author in self.proven:
            raise Refusal(Reason.BANNED, f"you signed two versions of your message of round "
                          f"{self.proven[author].first.round}")

    def _see(self, version: Version) -> bool:
        """Records a checked version; False, proving the equivocation, when it is a second one."""
        if version.author in self.proven:
            return False
        key = (version.round, version.author)
        held = self.versions.get(key)
        if held is None:
            self.versions[key] = version
            while len(self.versions) > MAX_VERSIONS:
                self.versions.popitem(last=False)
            return True
        if held.digest == version.digest:
            return True
        self._proven(Proof(held, version))
        return False

    def authors(self, round_index: int) -> set[str]:
        """The authors of the versions of `round_index` we hold: each finished the round and
        signed its message, which we or a member that reported it hold."""
        return {author for r, author in self.versions if r == round_index}

    def forget_before(self, round_index: int) -> None:
        for key in [k for k in self.versions if k[0] < round_index]:
            del self.versions[key]
        for old in [r for r in self._unreported if r < round_index]:
            del self._unreported[old]

    # ------------------------------------------------------------------ proofs
    def _proven(self, proof: Proof) -> None:
        if proof.author in self.proven or proof.author == self.swarm.peer_id:
            return
        self.proven[proof.author] = proof
        while len(self.proven) > MAX_PROVEN:
            self.proven.popitem(last=False)
        self.on_proof(proof)
        message = OutgoingMessage(EVIDENCE, proof.first.round, [], proof.meta())
        for member in self.members():
            if member != proof.author:
                self._spawn_push(member, message, f"evidence against {proof.author[-8:]}")

    async def _on_evidence(self, received: ReceivedMessage) -> None:
        try:
            proof = Proof.from_message(received)
        except ValueError as exc:
            raise Refusal(Reason.MALFORMED, f"an equivocation proof that is none: {exc}") from None
        if proof.author in self.proven or proof.author == self.swarm.peer_id:
            return
        if not all(await self.swarm.loop.run_in_executor(
                None, lambda: [self.signed(proof.first), self.signed(proof.second)])):
            raise Refusal(Reason.BAD_SIGNATURE, f"the two versions of {proof.author}'s message "
                          f"of round {proof.first.round} are not both signed by it: forged proof")
        self._proven(proof)

    # ------------------------------------------------------------------ telling the members
    def report(self) -> None:
        """Sends each member the versions we accepted since we last did, one message a round
        (called often; sends at most every SEEN_EVERY_S)."""
        now = self.clock()
        if not self._unreported or now - self._reported_at < SEEN_EVERY_S:
            return
        self._reported_at = now
        batches, self._unreported = self._unreported, {}
        members = self.members()
        for round_index, versions in batches.items():
            entries = [[v.author, v.digest, v.signature] for v in versions
                       if v.author not in self.proven][:self._max_entries()]
            if not entries:
                continue
            data = np.frombuffer(msgpack.packb(entries), dtype=np.uint8)
            message = OutgoingMessage(SEEN, round_index, [OutgoingTensor(ENTRIES, "uint8", data.shape, data)])
            for member in members:
                self._spawn_push(member, message, f"versions seen in round {round_index}")

    def _spawn_push(self, peer: str, message: OutgoingMessage, what: str) -> None:
        async def push() -> None:
            try:
                await self.transport.push(peer, message)  # bounded by its bytes (p2p/progress.py)
            except P2PError as exc:
                log.debug("%s to %s not sent: %s", what, peer[-8:], failure_sentence(exc))
        self.swarm.tasks.spawn(push(), f"dilocox {what} to {peer[-8:]}")

    async def _on_seen(self, received: ReceivedMessage) -> None:
        views = received.tensor_views()
        try:
            if set(views) != {ENTRIES}:
                raise ValueError(f"it holds tensors {sorted(views)[:3]}, not {ENTRIES!r}")
            entries = msgpack.unpackb(bytes(views[ENTRIES][1]), max_array_len=self._max_entries(),
                                      max_bin_len=64, max_str_len=128, max_map_len=0)
            versions = [Version(author, received.round, digest, signature)
                        for author, digest, signature in entries
                        if type(author) is str and type(digest) is bytes and type(signature) is bytes]
            if len(versions) != len(entries):
                raise ValueError("an entry is not [author, digest, signature]")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise Refusal(Reason.MALFORMED, f"a report of versions seen that is malformed ({exc})") from None
        new = [v for v in versions if v.author not in self.proven and v.author != self.swarm.peer_id
               and getattr(self.versions.get((v.round, v.author)), "digest", None) != v.digest]
        checked = await self.swarm.loop.run_in_executor(None, lambda: [self.signed(v) for v in new])
        for version, holds in zip(new, checked, strict=True):
            if not holds:
                raise Refusal(Reason.BAD_SIGNATURE, f"it reports a version of {version.author}'s "
                              f"message of round {version.round} that its author did not sign")
            self._see(version)
