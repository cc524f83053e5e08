"""Checks on every tensor a peer sends before it is used, and the bans that follow.

A contribution is refused when its names or shapes differ from the node's own tensors, when a
value is not finite, when its norm exceeds `max_norm_ratio` times the norm of the node's own
matching tensor set (a poisoned or scaled update), or, where the caller asks for it, when its
direction is no closer to the node's own than random noise is (`min_alignment_sigmas`: noise of
any norm has a cosine of about N(0, 1/d) with a fixed d-element tensor set, while honest
replicas' updates of the same round measured cosines of 0.5-0.9; a sign-flipped update is
refused too). NoLoCo applies it to a partner's progress Δ only, so only to snapshots that send
Δ (protocol.snapshot = "phi_delta"). The alignment check is off by default: it holds only while training makes
progress. At a plateau honest NoLoCo updates point anywhere relative to a node's own (three
20-minute soaks refused honest cosines of -0.05 to +0.014 from round ~110 on, floor 0.015),
and honest nodes struck and banned each other; a gate that used the check
only while the median of recent cosines was 1x or 4x the floor still banned honest peers. A
swarm that expects noise senders early in a run may turn it on. A refusal drops the
contribution, counts one strike against the sender, and `ban_after` strikes ban the sender for
`ban_seconds`.

Streams the transport refuses for misbehaviour (a replayed, forged, malformed or oversized
message, more streams than allowed, a stream left idle past its deadline) strike their sender
the same way (`transport_refusal`), and so does a peer that stores a forged member record in
our DHT (p2p/records.py names the sender of each store). Refusals an honest peer meets in
normal life (a stale round, clock skew, a truncated stream from a peer that crashed, an
application refusal that is already struck as a contribution) do not. Strikes count within a
window of `ban_seconds`, so an honest peer whose link drops now and then is not banned for
offences hours apart.

Invariant: a refused contribution never reaches the outer step; a banned peer's messages are
refused before their payload is read (the network layer asks `is_banned` first).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

log = logging.getLogger("lowcomm.contributions")

# Transport refusals (p2p.errors.Reason names) that only a misbehaving peer causes. Not here:
# STALE_ROUND, EXPIRED, WRONG_VERSION, UNSUPPORTED, WRONG_SWARM, WRONG_MANIFEST, WRONG_RECIPIENT
# (a peer on another round, clock, version or swarm), TRUNCATED (a peer killed mid-transfer),
# BANNED, REFUSED (struck as a contribution already), INTERNAL (our own failure), HELD (a copy
# a member handed on came first: node/rounds/dilocox/relay.py) and NO_ROOM
# (this node's room for incoming bytes is taken: every size the manifest allows fits alone,
# p2p/sizing.py). BUSY is a flood of streams or messages beyond what an honest peer opens.
# TIMEOUT is here although a cut link causes it too: the ban expires, and the window keeps a
# peer whose link drops now and then from collecting strikes.
MISBEHAVIOUR = frozenset({"BAD_SIGNATURE", "WRONG_SENDER", "BAD_DIGEST", "REPLAYED", "MALFORMED",
                          "TOO_LARGE", "BUSY", "TIMEOUT"})
MAX_TRACKED_PEERS = 1024


class ContributionRefused(ValueError):
    """Why a contribution was dropped: `reason` is a short code, str() one sentence."""

    def __init__(self, reason: str, sentence: str):
        super().__init__(sentence)
        self.reason = reason


def global_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().float().pow(2).sum()) for t in tensors.values()))


def check_contribution(sender: str, received: Mapping[str, torch.Tensor],
                       reference: Mapping[str, torch.Tensor], reference_norm: float,
                       max_norm_ratio: float, what: str, min_alignment_sigmas: float = 0.0) -> None:
    """Raises ContributionRefused naming the first problem; returns quietly when usable.

    `reference` is the node's own tensors of the same meaning (its φ for a peer's φ, its Δ for a
    peer's Δ, its θ for a peer's θ), `reference_norm` their global norm (computed by the caller).
    `min_alignment_sigmas` > 0 also refuses a contribution whose cosine with `reference` is
    below that many standard deviations of noise, 1/sqrt(elements) each.
    """
    if set(received) != set(reference):
        missing = sorted(set(reference) - set(received))[:3]
        extra = sorted(set(received) - set(reference))[:3]
        raise ContributionRefused("layout", f"{what} from {sender} has the wrong tensor names "
                                  f"(missing {missing}, unexpected {extra}); dropped")
    for name, tensor in received.items():
        if tuple(tensor.shape) != tuple(reference[name].shape):
            raise ContributionRefused("layout", f"{what} from {sender} has tensor {name} of shape "
                                      f"{tuple(tensor.shape)}, expected "
                                      f"{tuple(reference[name].shape)}; dropped")
        if not bool(torch.isfinite(tensor).all()):
            raise ContributionRefused("not_finite", f"{what} from {sender} holds NaN or Inf in "
                                      f"tensor {name}; dropped")
    norm = global_norm(received)
    # A tiny floor keeps a node whose own update is zero (first round) from refusing everyone.
    bound = max_norm_ratio * max(reference_norm, 1e-6)
    if norm > bound:
        raise ContributionRefused("norm", f"{what} from {sender} has norm {norm:.4g}, more than "
                                  f"{max_norm_ratio:g}x this node's own {reference_norm:.4g}; "
                                  f"dropped")
    if min_alignment_sigmas > 0 and norm > 0 and reference_norm > 0:  # zero: nothing to compare
        elements = sum(t.numel() for t in received.values())
        dot = sum(float(torch.dot(t.detach().reshape(-1).float(),
                                  reference[n].detach().reshape(-1).float()))
                  for n, t in received.items())
        cosine, floor = dot / (norm * reference_norm), min_alignment_sigmas / math.sqrt(elements)
        if cosine < floor:
            raise ContributionRefused("noise", f"{what} from {sender} points nowhere near this "
                                      f"node's own (cosine {cosine:.2g}, below the noise floor "
                                      f"{floor:.2g}): random or reversed, dropped")


@dataclass
class BanList:
    """Strikes per peer and timed bans. `clock` is injectable so tests need no sleeping."""

    ban_after: int
    ban_seconds: float
    clock: Callable[[], float] = time.monotonic
    strikes: dict[str, deque] = field(default_factory=dict)   # peer -> times of its strikes
    banned_until: dict[str, float] = field(default_factory=dict)
    refused_by_reason: Counter = field(default_factory=Counter)
    # Refusals that neither a round's outcome nor the transport's counters count (a forged member
    # record, a lying state server): the daemon adds these to the status view's `refused`.
    other_refusals: Counter = field(default_factory=Counter)

    def strike(self, peer: str, reason: str) -> bool:
        """Counts one refusal; returns True when this strike bans the peer (`ban_after`
        strikes within `ban_seconds`)."""
        self.refused_by_reason[reason] += 1
        now = self.clock()
        times = self.strikes.setdefault(peer, deque())
        times.append(now)
        while times and times[0] <= now - self.ban_seconds:
            times.popleft()
        if len(times) >= self.ban_after:
            self.banned_until[peer] = now + self.ban_seconds
            del self.strikes[peer]
            return True
        if len(self.strikes) > MAX_TRACKED_PEERS:  # peer ids are free to mint: stay bounded
            del self.strikes[next(iter(self.strikes))]
        return False

    def refuse(self, peer: str, reason: str, sentence: str,
               ban: Callable[[str, float], None], counted_elsewhere: bool = True) -> None:
        """Logs a refused contribution, strikes its sender, and calls `ban` when that bans it
        (the transport then refuses the peer's streams for `ban_seconds`). `counted_elsewhere`
        False: no round outcome reports it, so it goes to `other_refusals`."""
        log.warning("%s", sentence)
        if not counted_elsewhere:
            self.other_refusals[reason] += 1
        if self.strike(peer, reason):
            log.warning("banned %s for %.0f s after repeated refused contributions", peer,
                        self.ban_seconds)
            ban(peer, self.ban_seconds)

    def ban_now(self, peer: str, reason: str, sentence: str,
                ban: Callable[[str, float], None]) -> None:
        """Bans `peer` at once: for an offence that is proof, not a symptom (a member caught
        lying about the state it serves, node/daemon/state_quorum.py), where strikes would only
        let it spoil `ban_after` - 1 more joins first."""
        log.warning("%s; banned for %.0f s", sentence, self.ban_seconds)
        self.refused_by_reason[reason] += 1
        self.other_refusals[reason] += 1
        self.strikes.pop(peer, None)
        self.banned_until[peer] = self.clock() + self.ban_seconds
        ban(peer, self.ban_seconds)

    def transport_refusal(self, peer: str, reason: str, ban: Callable[[str, float], None]) -> None:
        """The transport refused a stream of `peer` for `reason` (a p2p Reason name): strikes
        it when the reason is misbehaviour, and bans it through `ban` on the last strike."""
        if reason not in MISBEHAVIOUR:
            return
        if self.strike(peer, reason.lower()):
            log.warning("banned %s for %.0f s after repeated refused streams (last: %s)", peer,
                        self.ban_seconds, reason)
            ban(peer, self.ban_seconds)

    def is_banned(self, peer: str) -> bool:
        until = self.banned_until.get(peer)
        if until is None:
            return False
        if self.clock() >= until:
            del self.banned_until[peer]
            return False
        return True

    def banned(self) -> list[str]:
        return sorted(p for p in list(self.banned_until) if self.is_banned(p))
