"""Which members send their DiLoCoX message in a round: a committee anyone can compute
(docs/protocols.md §3, "a per-round committee of senders").

When every member sends to every other, a node's bytes per round grow with the swarm: N − 1
copies of its message. With a committee, a member sends in round r only when

    u(id, ⌊r / T⌋) < p,   p = min(1, k / 2^⌈log₂ N⌉)

u: the first 8 bytes of BLAKE2b(id ‖ r) read as a number in [0, 1); T: the tenure, rounds a
member drawn serves in a row (the manifest's `senders_tenure`, 8 by default), so that its error
feedback acts in consecutive rounds rather than once in N / k (a member's first message of a
term carries the residual it kept since its last; measured at 32 and 64 replicas, T = 8 ended
below local-only where T = 1 ended 2-5% above it); k: the senders wanted per round (the
manifest's `senders`, 8 by default); N: the swarm's size, rounded up to a power of two so that
members whose views of the swarm differ a little draw the same committee. About k members send
a round, each about once every N / k rounds, whatever N: a node's bytes per round, averaged
over rounds, are about k·(N − 1)/N messages. A member that does not send keeps its round
(protocol/dilocox.py `keep`) and its next message says how many rounds it waited; how much of
them it carries is `kept_decay` (by default none: work that stale cost more than it gave,
measured in protocol/dilocox.py's docstring), and the outer step divides the sum of the
messages by the rounds of work they carry.
"""

from __future__ import annotations

import hashlib

from protocol.errors import ConfigurationError


def send_share(senders: int, swarm_size: int) -> float:
    """p = min(1, k / 2^⌈log₂ N⌉); 1 (everyone sends) when k = 0."""
    if type(senders) is not int or senders < 0 or type(swarm_size) is not int or swarm_size < 1:
        raise ConfigurationError(f"a committee needs senders >= 0 and a swarm size >= 1, got "
                                 f"senders={senders!r}, swarm size={swarm_size!r}.")
    if senders == 0:
        return 1.0
    return min(1.0, senders / (1 << (swarm_size - 1).bit_length()))


def draw(node_id: str, round_index: int) -> float:
    """u(id, r) in [0, 1): the same on every node, unknown before the round is named."""
    digest = hashlib.blake2b(f"{node_id}\x00{round_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def sends(node_id: str, round_index: int, share: float, tenure: int = 1) -> bool:
    """Whether `node_id` is in round `round_index`'s committee at send share p, members serving
    `tenure` rounds in a row."""
    return share >= 1.0 or draw(node_id, round_index // tenure) < share
