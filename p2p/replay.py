"""Replay protection: a signed frame is accepted at most once.

Every frame header carries a random nonce, its frame index and the sender's clock, all signed.
Headers whose clock is further than `window_s` from ours are refused as EXPIRED by the wire
checks, so remembering (sender, nonce, frame) for twice that window is enough to refuse every
identical replay. Memory is bounded per peer, in the number of peers and in total (about 150
bytes per entry); when a bound is reached new frames are refused BUSY rather than forgetting old
ones (forgetting would reopen the replay window). Only frames that passed the signature, swarm,
manifest, recipient and round checks get here, so only swarm members can use up the room.
"""

from __future__ import annotations

from collections import OrderedDict


class ReplayGuard:
    def __init__(self, window_s: float, max_entries_per_peer: int = 16_384, max_peers: int = 1024,
                 max_entries: int = 262_144):
        self.retention_s = 2 * window_s
        self.max_entries_per_peer = max_entries_per_peer
        self.max_peers = max_peers
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, OrderedDict[tuple, float]] = OrderedDict()
        self._count = 0

    def check_and_remember(self, sender: bytes, nonce: bytes, frame: int, now: float) -> str:
        """Return "new" (now remembered), "replayed", or "full" (this peer's share is used up)."""
        entries = self._seen.get(sender)
        if entries is None:
            self._prune_peers(now)
            if len(self._seen) >= self.max_peers:
                return "full"
            entries = self._seen[sender] = OrderedDict()
        else:
            self._seen.move_to_end(sender)
        self._expire(entries, now)
        key = (nonce, frame)
        if key in entries:
            return "replayed"
        if len(entries) >= self.max_entries_per_peer:
            return "full"
        if self._count >= self.max_entries:
            self._prune_peers(now)
            if self._count >= self.max_entries:
                return "full"
        entries[key] = now + self.retention_s
        self._count += 1
        return "new"

    def _expire(self, entries: OrderedDict, now: float) -> None:
        # Entries are appended in arrival order, so expired ones sit at the front.
        while entries and next(iter(entries.values())) < now:
            entries.popitem(last=False)
            self._count -= 1

    def _prune_peers(self, now: float) -> None:
        for sender in list(self._seen):
            entries = self._seen[sender]
            self._expire(entries, now)
            if not entries:
                del self._seen[sender]

    def __len__(self) -> int:
        return self._count


class RefusedMessages:
    """Messages refused at their first stream, remembered so that their other streams get the
    same answer without counting the offence again: one refused message is one refusal to the
    node's strikes, whatever the number of streams it was split over (a 4-stream message refused
    once per stream made honest peers ban each other after one refused swap).

    A message is remembered for as many more streams as its signed header declares; a stream
    beyond those is counted anew. Bounded: the oldest entries are forgotten first.
    """

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._refused: OrderedDict[tuple[bytes, bytes], list] = OrderedDict()

    def remember(self, sender: bytes, nonce: bytes, streams: int, refusal: Exception) -> None:
        if streams > 1:
            self._refused[(sender, nonce)] = [refusal, streams - 1]
            while len(self._refused) > self.max_entries:
                self._refused.popitem(last=False)

    def earlier(self, sender: bytes, nonce: bytes) -> Exception | None:
        """The refusal this message already got, for one more of its streams; else None."""
        entry = self._refused.get((sender, nonce))
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] <= 0:
            del self._refused[(sender, nonce)]
        return entry[0]
