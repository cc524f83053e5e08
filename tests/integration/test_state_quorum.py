"""Issue 24: a lying state server never gets its state adopted by a late joiner, and is banned.

Real parts: every member is a real p2pd host with its signed member record in the real DHT and
a real Transport serving its outer state; the joiner runs node/daemon/state_quorum.py with a
real MemberCache and BanList, as node/daemon/join.py does (a node resuming far behind takes the
same path). Two honest members and one liar; the liar's lie changes from case to case:

- wrong round: its record (and its state) claim round 10^6;
- poisoned weights whose digest it announced itself (NaN, and 1000x the honest norm);
- a state far from the majority (NoLoCo: its own, announced; DiLoCoX: a minority digest);
- a state other than the one it announced (DiLoCoX: it announces the majority's digest);
- a far state announced for a later round (NoLoCo: 6 rounds ahead, set aside; DiLoCoX: one
  round, a lone vote).

Each case asserts the joiner adopts an honest state, at the round a majority reached, and that
the liar is banned (where its lie is proof; a DiLoCoX member announcing a minority digest is not
banned, see state_quorum.py, but never asked either). The last two tests are a DiLoCoX resync's
and the replay that comes before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random

import numpy as np
import pytest
import torch

from node.config.manifest import ProtocolSection
from node.config.settings import NodeTimeouts
from node.daemon.members import MemberCache
from node.daemon.state_quorum import StateAdoption
from node.events import ReplayReady, ResyncReady
from node.loop import BackgroundTasks
from node.rounds.contributions import BanList
from node.rounds.dilocox.link import Download, Replay
from node.rounds.dilocox.exchange import DiLoCoXExchange
from node.rounds.dilocox.relay import Relay
from node.rounds.dilocox.replay import StepReplay
from node.rounds.dilocox.sending import PGRAD
from node.daemon.state_serving import StateServer
from node.rounds.state import SKETCH_MAX_VALUES, StateLayout, announcement
from p2p.errors import Reason, Refusal
from p2p.membership import Membership
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.origin import sign_origin
from p2p.streams import Transport
from protocol.tensors import weights_digest
from tests.p2p_helpers import as_received, run, wait_until
from tests.state_peer import FixedState
from tests.swarm_harness import small_manifest
from tests.swarm_parts import member, unit_swarm

pytestmark = pytest.mark.integration
HONEST_ROUND = 11          # members train round 11, so φ after round 10 is what they announce
LIE_ROUND = 10 ** 6
TIMEOUTS = NodeTimeouts(state_announce_wait_s=1.0, state_agreement_wait_s=20.0)


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g) * scale, "b": torch.randn(32, generator=g) * scale}


def nudged(base: dict, seed: int, relative: float) -> dict[str, torch.Tensor]:
    """`base` plus noise of `relative` times its norm."""
    noise = tensors(seed)
    factor = relative * math.sqrt(sum(float(t.square().sum()) for t in base.values())) \
        / math.sqrt(sum(float(t.square().sum()) for t in noise.values()))
    return {n: base[n] + factor * noise[n] for n in base}


class Member:
    """A host that announces a φ in its member record and serves a state when asked."""

    def __init__(self, host, manifest):
        self.host, self.manifest = host, manifest
        self.peer = host.peer_id.to_base58()
        self.transport = Transport(host.p2p, host.identity, swarm=manifest.swarm.id, manifest=manifest.digest)
        self.membership = Membership(host, manifest.swarm.id, protocol=manifest.protocol.name,
                                     manifest=manifest.digest, ttl_s=30)
        self.served = FixedState()
        self.round_now = 0
        self.server = StateServer(self.served, lambda: self.round_now)  # the node's own server
        self.server.register(self.transport)

    async def start(self) -> None:
        await self.transport.start()
        await self.membership.start()

    async def stop(self) -> None:
        await self.membership.leave()
        await self.transport.stop()

    async def behave(self, phi: dict, *, round_index: int = HONEST_ROUND, announced: dict | None = None,
                     phi_round: int | None = None) -> str:
        """Serve φ (momentum: a hundredth of it) as of `phi_round`, and announce `announced`'s
        digest (default: φ's own) for that round. Returns the served φ's digest."""
        phi_round = round_index - 1 if phi_round is None else phi_round
        groups = {"phi": phi, "momentum": {n: t / 100 for n, t in phi.items()}}
        digest = weights_digest(phi)
        shown = weights_digest(announced) if announced is not None else digest
        # a liar names the digest it announced, whatever it serves
        self.served.state, self.round_now = (phi_round, groups, shown), round_index
        extra = announcement(shown, phi_round, {"phi": "0" * 32, "phi_round": phi_round - 1})
        await self.membership.update(round=round_index, status="training", extra=extra)
        return digest


@contextlib.asynccontextmanager
async def running_members(p2p_cleanup, tmp_path, manifest, count: int):
    """`count` Members on real hosts, started, and stopped at the end."""
    async with p2p_cleanup.hosts(tmp_path, count) as hosts:
        members = [Member(h, manifest) for h in hosts]
        for each in members:
            await each.start()
        try:
            yield members
        finally:
            for each in members:
                await each.stop()


async def join_once(joiner: Member, manifest, members: list[Member], rng_first: str | None,
                    meanwhile=None, reference: dict | None = None):
    """A fresh joiner's view (cache, bans) of the swarm as it stands; its adopted state and bans.
    `meanwhile(adoption)`, if given, runs beside the adoption (a swarm that moves on);
    `reference`: the joiner's own φ (default: `tensors(99)`)."""
    bans = BanList(ban_after=3, ban_seconds=600)
    cache = MemberCache(joiner.membership, BackgroundTasks(), manifest=manifest.digest, bans=bans, refresh_s=0.2)
    expected = {m.peer: m.membership.record.round for m in members}
    await cache.start()
    try:
        await wait_until(lambda: _sees(cache, expected), 20, what="the joiner to see every member's record")
        rng = random.Random()
        if rng_first is not None:  # DiLoCoX: pick the order in which the liar is asked first
            holders = sorted(expected)
            rng = next(random.Random(seed) for seed in range(1000)
                       if _first(random.Random(seed), holders) == rng_first)
        adoption = StateAdoption(joiner.transport, cache, bans, manifest, TIMEOUTS,
                                 tensors(99) if reference is None else reference, rng)
        joined, _ = await asyncio.gather(adoption.run(), meanwhile(adoption) if meanwhile else asyncio.sleep(0))
        return joined, bans
    finally:
        await cache.stop(5)


async def _sees(cache: MemberCache, rounds: dict[str, int]) -> bool:
    await cache.refresh()
    return {r.peer_id: r.round for r in cache.peers()} == rounds


def _first(rng: random.Random, holders: list[str]) -> str:
    order = list(holders)
    rng.shuffle(order)
    return order[0]


def scenario(tmp_path, p2p_cleanup, protocol: str, cases):
    manifest = small_manifest(f"t-quorum-{protocol}", protocol)

    async def body():
        async with running_members(p2p_cleanup, tmp_path, manifest, 4) as members:
            honest_a, honest_b, liar, joiner = members
            for name, lie, expect_ban in cases:
                honest_digests = await lie(honest_a, honest_b, liar)
                joined, bans = await join_once(joiner, manifest, [honest_a, honest_b, liar],
                                               liar.peer if name.endswith("(asked first)") else None)
                assert joined is not None, name
                assert joined.source in (honest_a.peer, honest_b.peer), f"{name}: adopted the liar's state"
                assert weights_digest(joined.tensors["phi"]) in honest_digests, name
                assert joined.round_index == HONEST_ROUND, f"{name}: started at {joined.round_index}"
                assert bans.is_banned(liar.peer) == expect_ban, f"{name}: banned {bans.is_banned(liar.peer)}"
                if expect_ban:
                    assert liar.host.peer_id.to_bytes() in joiner.transport._bans, name
                assert not bans.is_banned(honest_a.peer) and not bans.is_banned(honest_b.peer), name
                joiner.transport.unban(liar.peer)   # the next case starts with a fresh joiner view
    run(body(), timeout_s=240)


def test_noloco_late_join_adopts_no_liars_state_and_bans_it(tmp_path, p2p_cleanup):
    base = tensors(1)
    a, b = nudged(base, 2, 0.01), nudged(base, 3, 0.01)

    async def honest(honest_a, honest_b) -> set[str]:
        return {await honest_a.behave(a), await honest_b.behave(b)}

    def case(phi, **how):
        async def lie(honest_a, honest_b, liar):
            digests = await honest(honest_a, honest_b)
            await liar.behave(phi, **how)
            return digests
        return lie

    poisoned_nan = {n: t.clone() for n, t in a.items()}
    poisoned_nan["w"][3, 4] = float("nan")
    run_cases = [
        ("wrong round", case(nudged(base, 4, 0.01), round_index=LIE_ROUND), True),
        ("NaN weights, own digest announced", case(poisoned_nan), True),
        ("1000x weights, own digest announced", case({n: t * 1000 for n, t in a.items()}), True),
        ("far from the majority, own digest announced", case(nudged(base, 5, 0.8)), True),
        # an honest member that ran rounds ahead trained its φ away: not adopted, not banned
        ("far, announced for a round well ahead of the others'", case(nudged(base, 5, 0.8),
                                                                      round_index=HONEST_ROUND + 6), False),
        ("serves another state than it announced", case(nudged(base, 6, 0.8), announced=nudged(base, 7, 0.01)),
         True),
    ]
    scenario(tmp_path, p2p_cleanup, "noloco", run_cases)


def test_noloco_late_join_asks_again_after_a_round_when_two_honest_states_disagree(tmp_path, p2p_cleanup):
    """Two honest states further apart than the tolerance (early training) are not adopted and
    nobody is banned; the joiner waits for the swarm's next round, asks again, and adopts."""
    manifest = small_manifest("t-quorum-retry", "noloco")
    base = tensors(1)

    async def body():
        async with running_members(p2p_cleanup, tmp_path, manifest, 3) as members:
            honest_a, honest_b, joiner = members
            await honest_a.behave(nudged(base, 2, 0.4))
            await honest_b.behave(nudged(base, 3, 0.4))   # about 0.57 of φ's norm apart
            closer: set[str] = set()

            async def next_round(adoption):
                async def refused():
                    return adoption.errors
                await wait_until(refused, 30, what="the joiner to find the two states apart")
                assert "apart" in adoption.errors[0], adoption.errors
                for honest, seed in ((honest_a, 4), (honest_b, 5)):
                    closer.add(await honest.behave(nudged(base, seed, 0.01), round_index=HONEST_ROUND + 1))

            joined, bans = await join_once(joiner, manifest, [honest_a, honest_b], None, next_round)
            assert joined is not None, "no state adopted after the swarm's next round"
            assert weights_digest(joined.tensors["phi"]) in closer
            assert joined.round_index == HONEST_ROUND + 1
            assert not bans.is_banned(honest_a.peer) and not bans.is_banned(honest_b.peer)
    run(body(), timeout_s=120)


def wide(seed: int, base: dict | None = None) -> dict[str, torch.Tensor]:
    """A state of about a million parameters (8.4 MB with its momentum: 20 ranges); near `base`."""
    g = torch.Generator().manual_seed(seed)
    fresh = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1024, generator=g)}
    return fresh if base is None else {n: base[n] + 0.01 * fresh[n] for n in base}


def test_a_noloco_joiner_fetches_the_bytes_of_one_state_and_only_sketches_of_the_others(tmp_path, p2p_cleanup):
    """Three honest members with states of their own: the quorum compares sketches, and the
    joiner receives about one state's bytes (not three), from one member, and adopts it."""
    manifest = small_manifest("t-quorum-once", "noloco")
    base = wide(1)
    total = StateLayout.of(base).total

    async def body():
        async with running_members(p2p_cleanup, tmp_path, manifest, 4) as members:
            *holders, joiner = members
            digests = {await m.behave(wide(2 + i, base)) for i, m in enumerate(holders)}
            before = joiner.transport.counters.bytes_received
            sent = [m.transport.counters.bytes_sent for m in holders]
            joined, bans = await join_once(joiner, manifest, holders, None, reference=wide(99))
            received = joiner.transport.counters.bytes_received - before
            assert received <= 1.15 * total, f"{received} bytes received for a state of {total}"
            assert joined is not None and weights_digest(joined.tensors["phi"]) in digests
            served = sorted(m.transport.counters.bytes_sent - s for m, s in zip(holders, sent))
            assert served[-1] >= total and sum(served[:-1]) <= 0.1 * total, served
            assert joined.bytes_fetched == total and len(joined.sources) == 1, joined.sources
            assert not any(bans.is_banned(m.peer) for m in holders)
    run(body(), timeout_s=120)


def test_a_noloco_download_that_breaks_resumes_at_the_nearest_agreeing_state_without_fetching_again(
        tmp_path, p2p_cleanup):
    """Each member stops serving ranges after its 8th (as one that left mid-transfer would: the
    refusal ends its part of the download): of 20 ranges, the chosen member serves 8, the
    agreeing state nearest it the next 8, the third the last 4. The joiner receives one state's
    bytes (and the sketches), and adopts exactly the ranges each served, banning nobody."""
    manifest = small_manifest("t-quorum-resume", "noloco")
    base = wide(1)
    layout = StateLayout.of(base)
    chunk = layout.chunk_bytes()

    async def body():
        async with running_members(p2p_cleanup, tmp_path, manifest, 4) as members:
            *holders, joiner = members
            for i, m in enumerate(holders):
                await m.behave(wide(2 + i, base))
                served = []

                async def leaving(header, server=m.server, served=served):
                    if "offset" in header.meta:
                        if len(served) >= 8:
                            raise Refusal(Reason.REFUSED, "this member is leaving")
                        served.append(header.meta["offset"])
                    return await server.respond(header)
                m.server.register(m.transport, leaving)
            before = joiner.transport.counters.bytes_received
            joined, bans = await join_once(joiner, manifest, holders, None, reference=wide(99))
            received = joiner.transport.counters.bytes_received - before
            assert joined is not None and len(joined.sources) == 3, joined and joined.sources
            sketches = 7 * 4 * SKETCH_MAX_VALUES  # three to choose, one fresh of each server, slack
            assert received <= layout.total + sketches, f"{received} bytes for a state of {layout.total}"
            assert joined.bytes_fetched == layout.total
            flat = torch.cat([t.reshape(-1) for g in ("phi", "momentum")
                              for _, t in sorted(joined.tensors[g].items())]).numpy().view(np.uint8)
            by_peer = {m.peer: m for m in holders}
            for k, source in enumerate(joined.sources):   # 8, 8 and 4 ranges, in that order
                state = by_peer[source].served.state[1]
                own = torch.cat([t.reshape(-1) for g in ("phi", "momentum")
                                 for _, t in sorted(state[g].items())]).numpy().view(np.uint8)
                start, end = 8 * k * chunk, min(layout.total, 8 * (k + 1) * chunk)
                assert np.array_equal(flat[start:end], own[start:end]), f"range {k} is not {source}'s"
            assert not any(bans.is_banned(m.peer) for m in holders)
    run(body(), timeout_s=120)


def test_dilocox_late_join_adopts_the_majority_digest_and_bans_a_lying_server(tmp_path, p2p_cleanup):
    shared = tensors(1)
    poisoned = {n: t * 1000 for n, t in shared.items()}

    def case(phi, **how):
        async def lie(honest_a, honest_b, liar):
            digests = {await honest_a.behave(shared), await honest_b.behave(shared)}
            await liar.behave(phi, **how)
            return digests
        return lie

    run_cases = [
        ("wrong round", case(shared, round_index=LIE_ROUND), True),
        # a minority digest: an honest member that missed a message announces one too
        ("1000x weights, own digest announced", case(poisoned), False),
        ("far from the majority, own digest announced", case(nudged(shared, 5, 0.8)), False),
        ("far, announced for a later round only it reached", case(nudged(shared, 5, 0.8),
                                                                  round_index=HONEST_ROUND + 1), False),
        ("serves poison under the majority's digest (asked first)", case(poisoned, announced=shared), True),
    ]
    scenario(tmp_path, p2p_cleanup, "dilocox", run_cases)


def test_dilocox_resync_bans_a_holder_serving_another_phi_and_takes_the_honest_one(tmp_path, p2p_cleanup):
    """The consensus check of a diverged DiLoCoX node (node/rounds/dilocox/exchange.py): the
    liar announces the majority's digest and is asked first, serves poison over a real stream,
    is banned, and the honest holder's state is the resync; the training thread then checks it
    as a contribution (tests/unit/test_dilocox_round.py)."""
    manifest = small_manifest("t-resync-liar", "dilocox")
    shared = tensors(1)

    async def body():
        async with running_members(p2p_cleanup, tmp_path, manifest, 3) as members:
            honest, liar, node = members
            digest = await honest.behave(shared)
            await liar.behave({n: t * 1000 for n, t in shared.items()}, announced=shared)
            events: list = []
            records = [member(m.peer, HONEST_ROUND, "dilocox", "training", since=0, phi=digest,
                              phi_round=HONEST_ROUND - 1) for m in (liar, honest)]  # the liar first
            swarm = unit_swarm(asyncio.get_running_loop(), records, peer_id=node.peer,
                               transport=node.transport, events=events)
            swarm.state_layout = StateLayout.of(shared)
            exchange = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
            await exchange.consensus.check(HONEST_ROUND - 1, "f" * 32)   # ours diverged
            resync = exchange.consensus.resyncs[HONEST_ROUND - 1]
            assert isinstance(resync, Download) and resync.source == honest.peer
            assert weights_digest(resync.phi) == digest
            assert [e.source for e in events if isinstance(e, ResyncReady)] == [honest.peer]
            assert swarm.bans.is_banned(liar.peer) and liar.host.peer_id.to_bytes() in node.transport._bans
    run(body(), timeout_s=120)


def test_a_diverged_dilocox_node_replays_its_step_over_real_streams_instead_of_downloading(
        tmp_path, p2p_cleanup):
    """The light form of the resync above (node/rounds/dilocox/replay.py): the holder of the
    majority's φ serves its record of the senders its step applied (APPLIED) and, through its
    relay, the author's message the diverged node lacked; both travel over real signed streams,
    the copy is checked against its author's signature, and no state is downloaded."""
    manifest = small_manifest("t-replay", "dilocox")
    shared = tensors(1)
    target = HONEST_ROUND - 2  # the step of round HONEST_ROUND - 1 applied this round (delay 1)

    def signed(author: Member, delivered_by: Member) -> ReceivedMessage:
        message = OutgoingMessage.from_arrays(PGRAD, target, {"c": np.arange(16, dtype=np.uint8)})
        sign_origin(author.host.identity, manifest.swarm.id, manifest.digest, message)
        return as_received(message, delivered_by.host.identity)

    async def body():
        loop = asyncio.get_running_loop()
        async with running_members(p2p_cleanup, tmp_path, manifest, 3) as members:
            holder, author, node = members
            digest = await holder.behave(shared)
            await author.behave(shared)
            holder_swarm = unit_swarm(loop, peer_id=holder.peer, transport=holder.transport)
            relay = Relay(holder_swarm, PGRAD, witness=lambda _author, _message: True,
                          clock=loop.time)
            replay = StepReplay(holder_swarm, relay, lambda: [author.peer, node.peer])
            relay.start()
            replay.start()
            senders = tuple(sorted([holder.peer, author.peer, node.peer]))
            replay.record(HONEST_ROUND - 1, (target, senders))
            relay.accepted(author.peer, signed(author, author))  # the holder got it by push
            events: list = []
            records = [member(m.peer, HONEST_ROUND, "dilocox", "training", since=0, phi=digest,
                              phi_round=HONEST_ROUND - 1) for m in (holder, author)]
            swarm = unit_swarm(loop, records, peer_id=node.peer, transport=node.transport,
                               events=events)
            exchange = DiLoCoXExchange(ProtocolSection(name="dilocox"), swarm, random.Random(0))
            exchange.relay.accepted(holder.peer, signed(holder, holder))  # ours missed the author's
            exchange.consensus.agreed = HONEST_ROUND - 2  # our φ of the round before was the majority's
            await exchange.consensus.check(HONEST_ROUND - 1, "f" * 32)   # ours diverged
            recipe = exchange.consensus.resyncs[HONEST_ROUND - 1]
            assert isinstance(recipe, Replay)
            assert recipe.steps == [(HONEST_ROUND - 1, target, senders)]
            assert recipe.digest == digest
            assert sorted(recipe.messages) == sorted([(target, holder.peer), (target, author.peer)])
            assert exchange.relay.authored_by(author.peer, recipe.messages[(target, author.peer)])
            assert [(e.source, e.fetched) for e in events if isinstance(e, ReplayReady)] == [(holder.peer, 1)]
            assert not [e for e in events if isinstance(e, ResyncReady)]
    run(body(), timeout_s=120)
