"""The φ the swarm settles on from its members' announced digests (docs/protocols.md §3: the agreed
state is bitwise identical on honest nodes). Every node computes the same winner from the same
votes, so a split heals instead of lasting."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def winning_digest(votes: Mapping[str, int]) -> str:
    """The φ digest the swarm settles on: the most votes, a tie going to the smallest digest.

    Every node must pick the same winner from the same votes, or a tie (two survivors that each
    applied a different set of messages) would never be broken and φ would stay split forever.
    """
    top = max(votes.values())
    return min(digest for digest, count in votes.items() if count == top)


def split_winner(holders: Mapping[str, Sequence[str]], round_index: int) -> str:
    """Where three or more voters announce as many digests (a total split: each applied another
    set of messages), the digest of the holder ranked first for this round,

        argmin over holders p of BLAKE2b(round ‖ p),

    not the smallest digest: a liar chooses its digest freely and would grind one that wins
    every split, while its peer id is fixed, so the rank makes it win about one split in N.
    Every node computes it from the same votes and picks alike, and a total split heals."""
    def rank(peer: str) -> bytes:
        return hashlib.blake2b(f"{round_index}:{peer}".encode(), digest_size=16).digest()
    first = min((peer for peers in holders.values() for peer in peers), key=rank)
    return next(digest for digest, peers in holders.items() if first in peers)
