"""The outer state a late joiner (or a node resuming far behind its swarm) adopts: never on one
member's word where more than one member can be asked.

- The round: `agreed_round`, the highest round a majority of the eligible members has reached
  (their signed records), not the maximum and not a server's reply: with honest members in the
  majority it lies within the honest members' rounds, whatever a liar claims. A member whose
  record or reply claims a round past `round_bound` of the agreed one (4x it, plus 16: beyond
  what members that started together and differ in speed reach; an assumption, not measured)
  is lying, is banned, and is never asked.
- DiLoCoX (members share one φ): the state of the latest round whose φ digest a majority of the
  eligible members announced (distinct identities, each one vote), downloaded once, range by
  range, from those holders (node/rounds/state_fetch.py: a holder that breaks off is resumed
  at the next, each range asked for that round and digest), and accepted only if its digest is
  that one. A holder that served all of φ and another φ than announced is lying and is banned;
  a φ assembled from several holders' ranges that fails blames none of them (any could have
  lied), and the next attempt starts at another holder. A member announcing a minority digest
  is not banned: an honest member that missed a message does that too until it resyncs.
- NoLoCo (each member holds its own φ): sketches of the states of up to `STATE_SOURCES` members
  (each state's values at the same elements, drawn from a seed the joiner picks:
  node/daemon/state_serving.py), each naming the digest its server signed in its announcement
  (else the server is banned), and the adopted state is the one that most of them agree with
  (distances and norms estimated from the sketches; exact where a sketch holds every element): within `tolerance` of a majority of the states asked (at
  least two). Why not a mean or a coordinate-wise median: the adopted state stays one that a
  member announced and trains from (φ and its momentum belong together); a state inside the
  honest ones' spread that wins the choice costs the joiner no more than the swarm's own spread.
  A state beyond the tolerance from the adopted one is "far from the majority": its server is
  banned, unless its round is more than `FAR_ROUND_SLACK` rounds from the adopted state's (an
  honest member that ran ahead, or fell behind, trained its φ away from the others': it is set
  aside, not banned). With two states they must agree within the tolerance or neither is
  adopted; then the joiner waits for the swarm's next round and asks again (`AGREEMENT_TRIES`
  in all): early in training two honest states stand apart for a round or two, until pairs
  pull them together (measured: 0.29-0.81 of the joiner's φ norm after 10 rounds of
  tests/integration/test_late_join_liars.py's swarm).
- NoLoCo downloads only the chosen state, once. A download that breaks resumes where it stopped
  at the agreeing state nearest the chosen one (the chosen member left): the state adopted is
  then assembled from their ranges, and lies within that member's distance of the chosen one,
  itself within the tolerance. Every server's ranges must equal its sketch's values where they
  fall, and those of a fresh sketch (a seed it did not know while serving) where it still
  answers; a mismatch, or a single server's state whose digest is not the one it announced,
  bans it. A member that left mid-transfer is judged by its first sketch alone.
- Every state is checked as a contribution is (node/rounds/contributions.py): the joiner's own
  tensor names and shapes, finite values, φ's and the momentum's norm within `max_norm_ratio`
  of the joiner's own φ. A state that fails is refused and its server banned.
- Every source is an eligible member (node/daemon/members.py: live, on our manifest, not
  banned), checked again before each download; the bans here are BanList bans, so the member
  view and the transport leave a liar out from then on.

A swarm with a single member that serves a state is joined on that member's word alone (there
is nobody else to ask): logged as such, and checked as above. Cost: a joiner downloads one
state's bytes (plus at most a range lost per holder that breaks off) and holds one state; a
NoLoCo joiner also receives a sketch (at most 256 KiB) of each of up to `STATE_SOURCES` members,
and one more of each server after its download. No download is cut by a fixed time: each range is bounded by its bytes at the
swarm's minimum link rate, a stalled one by `node.stall_s` (p2p/progress.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from node.config.manifest import Manifest
from node.config.settings import NodeTimeouts
from node.daemon.admission import AdmissionError, refused_admission
from node.daemon.members import MemberCache
from node.rounds.contributions import BanList, ContributionRefused, check_contribution, global_norm
from node.daemon.state_agreement import (SPREAD_TOLERANCE, _Candidate, _distance, _spread, _state_round,
                                         choose_agreed)
from node.rounds.state_fetch import FetchedState, StateFetchFailed, fetch_sketch, fetch_state
from node.rounds.state import STATE_KIND, StateLayout, agreed_round, majority, phi_holders, round_bound, settled
from p2p.errors import P2PError, Reason, RemoteRefused
from p2p.records import MemberRecord

log = logging.getLogger("lowcomm.join")
ANNOUNCEMENT_POLL_S = 0.1  # a joiner looks up a member's announcement this often, while waiting
STATE_SOURCES = 3          # NoLoCo: states compared before one is adopted (one liar among three loses)
# NoLoCo: a far state is proof of a lie only against states of about its own round: honest
# members pair while within max_staleness (2 by default) rounds of each other.
FAR_ROUND_SLACK = 2
# NoLoCo: states asked for this many times, a round apart, before the join gives up on agreement
AGREEMENT_TRIES = 3


@dataclass
class JoinState:
    round_index: int
    tensors: dict[str, dict[str, torch.Tensor]]  # group -> name -> fp32 tensor
    meta: dict
    source: str
    bytes_fetched: int = 0          # of the state's bytes, every range asked (an upper bound)
    sources: tuple[str, ...] = ()   # the members that served its ranges, in order


def claimed_round(record: MemberRecord) -> int:
    announced = [v for v in (record.extra.get("phi_round"), record.extra.get("phi_prev_round"))
                 if type(v) is int]
    return max([record.round, *announced])


def quorum_digest(members: list[MemberRecord]) -> tuple[int, str, list[str]] | None:
    """DiLoCoX: (round, digest, holders) of the latest round whose φ digest a majority of
    `members` announced; None if no round has one."""
    needed = majority(len(members))
    rounds = {v for r in members for v in (r.extra.get("phi_round"), r.extra.get("phi_prev_round"))
              if type(v) is int and v >= 0}
    for state_round in sorted(rounds, reverse=True):
        holders = phi_holders(members, state_round)
        votes = Counter({d: len(peers) for d, peers in holders.items()})
        for digest, count in votes.most_common(1):
            if count >= needed:
                return state_round, digest, holders[digest]
    return None


def check_state(source: str, groups: dict, reference: dict[str, torch.Tensor],
                reference_norm: float, max_norm_ratio: float) -> None:
    """A state's φ and momentum as contributions: the joiner's layout, finite, bounded norms."""
    for group in ("phi", "momentum"):
        check_contribution(source, groups[group], reference, reference_norm, max_norm_ratio,
                           f"the {group} of a state served")


class StateAdoption:
    """One late join's choice of state (see the module's docstring); `run()` once."""

    def __init__(self, transport, cache: MemberCache, bans: BanList, manifest: Manifest,
                 timeouts: NodeTimeouts, reference: dict[str, torch.Tensor],
                 rng: random.Random | None = None):
        """`reference`: the joiner's own φ (its layout, and the scale norms are judged by);
        `rng` picks whom to ask (random, so that no member is everyone's first server)."""
        self.transport, self.cache, self.bans, self.manifest = transport, cache, bans, manifest
        self.timeouts, self.reference, self.rng = timeouts, reference, rng or random.Random()
        self.reference_norm = global_norm(reference)
        self.layout = StateLayout.of(reference)
        self.errors: list[str] = []
        self.not_admitted = 0
        self.asked: set[str] = set()  # members asked for a state, a range or a sketch

    async def run(self) -> JoinState | None:
        """The verified state and the agreed start round; None when no member has a state."""
        members = self._members()
        if not any(r.round > 0 and r.extra.get("phi") for r in members):
            return None
        try:
            joined = await (self._dilocox() if self.manifest.protocol.name == "dilocox" else self._noloco())
        finally:
            await self._release()
        if joined is not None:
            return joined
        if self.errors and self.not_admitted == len(self.errors):
            raise AdmissionError(refused_admission(self.manifest.swarm.id,
                                                   self.transport.identity.peer_id.to_base58(),
                                                   f"all {self.not_admitted} members asked"))
        raise RuntimeError("late join failed: no state was agreed by more than one member and "
                           "verified (" + "; ".join(self.errors[:3] or ["no member served one"])
                           + "); retry later")

    # ------------------------------------------------------------------ the members' word
    def _members(self) -> list[MemberRecord]:
        """Eligible members, less (and banning) those whose records claim an impossible round."""
        members = settled(self.cache.eligible())
        bound = round_bound(agreed_round(members))
        for record in members:
            if claimed_round(record) > bound:
                self._ban(record.peer_id, "round", f"member {record.peer_id} claims round "
                          f"{claimed_round(record)} in its record, where a majority of the swarm is "
                          f"at round {agreed_round(members)} (at most {bound} is possible)")
        return [r for r in members if claimed_round(r) <= bound]

    def _ban(self, peer: str, reason: str, sentence: str) -> None:
        self.errors.append(sentence)
        self.bans.ban_now(peer, f"state_{reason}", sentence, self.transport.ban)

    def _start_round(self, state_round: int) -> int:
        return max(agreed_round(self._members()), state_round + 1)

    # ------------------------------------------------------------------ DiLoCoX
    async def _dilocox(self) -> JoinState | None:
        deadline = time.monotonic() + self.timeouts.state_announce_wait_s
        while (agreed := quorum_digest(self._members())) is None:
            if time.monotonic() > deadline:  # announcements lag rounds a little: look again
                self.errors.append(f"no φ digest is announced by a majority of the "
                                   f"{len(self._members())} eligible members for any round")
                return None
            await self._refresh()
        state_round, digest, holders = agreed
        holders = sorted(holders)
        self.rng.shuffle(holders)
        await self._keep(holders[1:], state_round, digest)
        for attempt in range(self.timeouts.state_download_attempts):
            # each attempt starts at another holder; a break resumes at the next one
            candidate = await self._download(holders[attempt:] + holders[:attempt], state_round, digest)
            if candidate is None:
                continue
            if candidate.meta.get("phi_round") != state_round:  # it no longer holds that round
                self.errors.append(f"{candidate.source}: serves round {candidate.meta.get('phi_round')}, "
                                   f"not the agreed round {state_round}")
                continue
            if candidate.digest != digest:
                self._refuse_digest(candidate, state_round, digest)
                continue
            if await self._passes_checks(candidate):
                return JoinState(self._start_round(state_round), candidate.groups, candidate.meta,
                                 candidate.source, candidate.bytes_fetched, candidate.sources)
        return None

    async def _release(self) -> None:
        """Tells every member asked for a state or a sketch that this join is over: each lets go
        the export our requests pinned (node/daemon/state_serving.py). Best effort: a member
        that does not answer lets it go when newer downloads' pins push it out."""
        async def one(holder: str) -> None:
            with contextlib.suppress(P2PError):  # bounded by the transport's stall bound
                await self.transport.request(holder, STATE_KIND, 0, meta={"release": True})
        await asyncio.gather(*(one(holder) for holder in self.asked))

    async def _keep(self, holders: list[str], state_round: int, digest: str) -> None:
        """Asks each of `holders` for one value of the state (a sketch): asking pins the state
        there (node/daemon/state_serving.py), so that a download resumed at it finds the state
        however many rounds the download outlasted. One that does not answer is tried anyway."""
        self.asked.update(holders)

        async def one(holder: str) -> None:
            with contextlib.suppress(P2PError, ValueError):
                await fetch_sketch(self.transport, holder, self.layout, 0, count=1,
                                   phi_round=state_round, digest=digest)
        await asyncio.gather(*(one(holder) for holder in holders))

    def _refuse_digest(self, candidate: _Candidate, state_round: int, digest: str) -> None:
        """A state whose φ is not the majority's: its server is banned if one member served
        all of φ; assembled from several members' ranges, nobody can be blamed."""
        if candidate.phi_server is not None:
            self._ban(candidate.source, "digest", f"member {candidate.source} served a φ of round "
                      f"{state_round} with digest {candidate.digest[:12]}, where it and a majority "
                      f"announced {digest[:12]}")
        else:
            self.errors.append(f"the φ of round {state_round} assembled from the ranges of "
                               f"several members has digest {candidate.digest[:12]}, "
                               f"not the majority's {digest[:12]}; none of them alone is to blame")

    # ------------------------------------------------------------------ NoLoCo
    async def _noloco(self) -> JoinState | None:
        """Sketches of several members' states; the one a majority agrees with is downloaded,
        once. Two honest states can stand further apart than the tolerance for a round or two
        (early training moves φ fast, and a pair's averaging pulls them back): then the
        swarm's next round is waited for and fresh sketches are asked, `AGREEMENT_TRIES` times
        in all; so is a choice none of whose agreeing states could be downloaded."""
        for attempt in range(1, AGREEMENT_TRIES + 1):
            held = await self._noloco_sketches()
            if not held:
                return None
            chosen, _ = choose_agreed(held)
            if chosen is None:
                self.errors.append(f"the states of {len(held)} members are {_spread(held):.2f} of "
                                   f"φ's norm apart (they agree within {SPREAD_TOLERANCE}; asked "
                                   f"{attempt} time{'s' * (attempt > 1)})")
                if attempt == AGREEMENT_TRIES or not await self._next_round(max(map(_state_round, held))):
                    return None
                log.info("%s; asking again after the swarm's next round", self.errors[-1])
                continue
            if len(held) == 1:
                log.warning("only member %s served a verifiable state: adopting it on its word alone "
                            "(checked: its announcement, layout, finite values, norms)", chosen.source)
            joined = await self._noloco_download(chosen, held)
            if joined is not None:
                return joined
        return None

    async def _noloco_sketches(self) -> list[_Candidate]:
        """Sketches (one seed) of up to `STATE_SOURCES` eligible members' states, each matching
        its server's announcement and passing the checks a sketch allows; far ones dropped."""
        asked: set[str] = set()
        held: list[_Candidate] = []
        seed = self.rng.getrandbits(62)
        attempts = self.timeouts.state_download_attempts + STATE_SOURCES  # a few may fail or lie
        while True:
            sources = [r.peer_id for r in self._members() if r.round > 0 and r.extra.get("phi")
                       and r.peer_id not in asked]
            wanted = min(STATE_SOURCES, len(held) + len(sources))
            if len(held) >= wanted or len(asked) >= attempts or not sources:
                break
            batch = self.rng.sample(sorted(sources), min(wanted - len(held), attempts - len(asked)))
            asked.update(batch)
            held += [c for c in await asyncio.gather(*(self._sketched(s, seed) for s in batch)) if c]
            if len(held) >= wanted:
                held = await self._drop_far(held)
        return [c for c in held if not self.bans.is_banned(c.source)]

    async def _sketched(self, source: str, seed: int) -> _Candidate | None:
        self.asked.add(source)
        try:
            sketch = await fetch_sketch(self.transport, source, self.layout, seed)
        except (P2PError, ValueError) as exc:
            self.errors.append(f"{source}: {exc}")
            self.not_admitted += isinstance(exc, RemoteRefused) and exc.reason == Reason.NOT_ADMITTED
            return None
        if not self._rounds_possible(source, sketch.meta):
            return None
        candidate = _Candidate(source, {}, sketch.digest, sketch.meta, source, sketch)
        if not await self._matches_announcement(candidate):
            return None
        norm = max(sketch.group_norms())
        ratio = self.manifest.contributions.max_norm_ratio
        if not np.isfinite(sketch.values).all():
            self._ban(source, "not_finite", f"the state of member {source} holds NaN or Inf where "
                      f"its sketch sampled it")
        elif norm > ratio * max(self.reference_norm, 1e-6):  # the rule of check_contribution
            self._ban(source, "norm", f"the state of member {source} has norm {norm:.4g} (estimated "
                      f"from its sketch), more than {ratio:g}x this node's own {self.reference_norm:.4g}")
        else:
            return candidate
        return None

    async def _noloco_download(self, chosen: _Candidate, held: list[_Candidate]) -> JoinState | None:
        """The chosen state's bytes, once: a download that breaks resumes where it stopped at
        the agreeing state nearest the chosen one (`choose_agreed` kept only states within its
        tolerance of the majority's), so the assembled state lies within that state's distance
        of the chosen one. A state that fails its checks is dropped whole; the next starts anew."""
        order = [chosen] + sorted((c for c in held if c is not chosen), key=lambda c: _distance(c, chosen))
        partial: FetchedState | None = None
        for candidate in order:
            if self.bans.is_banned(candidate.source):
                continue
            try:
                fetched = await fetch_state(self.transport, [candidate.source], self.layout,
                                            phi_round=_state_round(candidate), digest=candidate.digest,
                                            usable=lambda peer: not self.bans.is_banned(peer),
                                            resume=partial)
            except StateFetchFailed as exc:
                log.warning("the state did not arrive (%s)", exc)
                self.errors += [f"{source}: {error}" for source, error in exc.errors]
                partial = exc.partial
                continue
            partial = None
            if await self._assembled_passes(fetched, {c.source: c for c in order}):
                sources = fetched.sources  # an assembled state is named by its own digest
                return JoinState(self._start_round(_state_round(chosen)), fetched.groups,
                                 fetched.meta | {"phi": fetched.digest}, sources[0],
                                 fetched.bytes_fetched, tuple(sources))
        return None

    async def _assembled_passes(self, fetched: FetchedState, by_source: dict[str, _Candidate]) -> bool:
        """The downloaded state is what its servers showed: a single server's has the digest it
        announced; every server's ranges match its sketch, and a fresh sketch (a seed it did not
        know while serving) where it still answers; then the checks of any state."""
        parts = fetched.parts()
        if len(parts) == 1 and fetched.digest != (only := by_source[fetched.sources[0]]).digest:
            self._ban(only.source, "digest", f"member {only.source} served a state with digest "
                      f"{fetched.digest[:12]}, not the {only.digest[:12]} it announced")
            return False
        for source, ranges in parts.items():
            sketches = [by_source[source].sketch]
            with contextlib.suppress(P2PError, ValueError):  # one that left is judged by its first
                sketches.append(await fetch_sketch(
                    self.transport, source, self.layout, self.rng.getrandbits(62),
                    phi_round=_state_round(by_source[source]), digest=by_source[source].digest))
            wrong = sum(sketch.mismatches(fetched, start, end) for sketch in sketches for start, end in ranges)
            if wrong:
                self._ban(source, "sketch", f"member {source} served {wrong} values that differ "
                          f"from its own sketch of the state it announced")
                return False
        return await self._passes_checks(_Candidate(fetched.sources[-1], fetched.groups, fetched.digest,
                                                    fetched.meta))

    def _rounds_possible(self, source: str, meta: dict) -> bool:
        """A reply's round and state round are integers within `round_bound`; else its server is banned."""
        bound = round_bound(agreed_round(self.cache.eligible()))
        rounds = [v for v in (meta.get("round"), meta.get("phi_round")) if type(v) is int]
        if len(rounds) < 2 or max(rounds) > bound:
            self._ban(source, "round", f"member {source} served a state claiming rounds "
                      f"{meta.get('phi_round')!r}/{meta.get('round')!r}, where a majority of the swarm "
                      f"is at round {agreed_round(self.cache.eligible())} (at most {bound} is possible)")
            return False
        return True

    async def _next_round(self, state_round: int) -> bool:
        """Waits (up to a download's deadline) for a majority of members to pass `state_round`."""
        deadline = time.monotonic() + self.timeouts.state_agreement_wait_s
        while agreed_round(self._members()) <= state_round + 1:  # members train round phi_round + 1
            if time.monotonic() > deadline:
                return False
            await self._refresh()
        return True

    async def _drop_far(self, held: list[_Candidate]) -> list[_Candidate]:
        """Bans the servers of states far from the majority's; keeps the others."""
        chosen, far = await self._off_loop(choose_agreed, held)
        if chosen is None:
            return held
        for candidate, distance in far:
            apart = abs(_state_round(candidate) - _state_round(chosen))
            if apart > FAR_ROUND_SLACK:
                log.info("member %s served a φ %.2f of φ's norm from the majority's, %d rounds "
                         "apart from it: set aside, not banned", candidate.source, distance, apart)
                continue
            self._ban(candidate.source, "far", f"member {candidate.source} served a φ {distance:.2f} "
                      f"of φ's norm from the state {len(held) - len(far)} of {len(held)} members "
                      f"agree on (tolerance {SPREAD_TOLERANCE}): far from the majority")
        return [c for c in held if c not in [f for f, _ in far]]

    async def _matches_announcement(self, candidate: _Candidate) -> bool:
        """The state is the one its server announced (signed, in the DHT) for its round; an
        announcement that lags the state is waited for, briefly. A mismatch bans the server."""
        source, state_round = candidate.source, candidate.meta.get("phi_round")
        deadline = time.monotonic() + self.timeouts.state_announce_wait_s
        while True:
            record = next((r for r in self.cache.eligible() if r.peer_id == source), None)
            if record is None:
                self.errors.append(f"{source}: left or was banned while serving its state")
                return False
            expected = {record.extra[key] for key, announced in (("phi", "phi_round"),
                                                                  ("phi_prev", "phi_prev_round"))
                        if record.extra.get(announced) == state_round
                        and isinstance(record.extra.get(key), str)}
            if candidate.digest in expected:
                return True
            if time.monotonic() > deadline:
                shown = ", ".join(sorted(d[:12] for d in expected)) or "none"
                self._ban(source, "digest", f"member {source} served a state of round {state_round} "
                          f"with digest {candidate.digest[:12]}; it announced for that round: {shown}")
                return False
            await self._refresh()

    # ------------------------------------------------------------------ one download
    async def _download(self, holders: list[str], state_round: int | None,
                        digest: str | None = None) -> _Candidate | None:
        """One state from `holders` (a break resumes at the next one), of `state_round` and
        `digest` if given; its server's claimed rounds checked (node/rounds/state_fetch.py)."""
        self.asked.update(holders)
        try:
            fetched = await fetch_state(self.transport, holders, self.layout,
                                        phi_round=state_round, digest=digest,
                                        usable=lambda peer: not self.bans.is_banned(peer))
        except StateFetchFailed as exc:  # every holder failed mid-transfer or refused
            log.warning("the state did not arrive (%s)", exc)
            for source, error in exc.errors or [(",".join(holders), exc)]:
                self.errors.append(f"{source}: {error}")
                self.not_admitted += isinstance(error, RemoteRefused) and error.reason == Reason.NOT_ADMITTED
            return None
        source = fetched.sources[0]
        if not self._rounds_possible(source, fetched.meta):
            return None
        phi_server = fetched.served_phi_alone()
        return _Candidate(phi_server or source, fetched.groups, fetched.digest, fetched.meta, phi_server,
                          bytes_fetched=fetched.bytes_fetched, sources=tuple(fetched.sources))

    async def _passes_checks(self, candidate: _Candidate) -> bool:
        try:
            await self._off_loop(check_state, candidate.source, candidate.groups, self.reference,
                                 self.reference_norm, self.manifest.contributions.max_norm_ratio)
        except ContributionRefused as exc:
            self._ban(candidate.source, exc.reason, str(exc))
            return False
        return True

    @staticmethod
    async def _off_loop(function, *args):
        """Whole-model torch work (norms, distances) in a thread: the loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    async def _refresh(self) -> None:
        await asyncio.sleep(ANNOUNCEMENT_POLL_S)
        with contextlib.suppress(P2PError):
            await self.cache.refresh()
