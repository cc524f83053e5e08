"""Streams forwarded by a member (p2p/forwarding.py), on real p2pd hosts on loopback.

Three hosts: F (the first, which the others bootstrap from) forwards; A and B exchange through it.
On loopback every peer can dial every other, so the tests name F as the way to B, as a relayed
address would (tests/integration/test_nat.py runs the same code behind real NAT routers).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import numpy as np
import pytest

from p2p.errors import Reason, RemoteRefused
from p2p.forwarding import FORWARDED_PROTOCOL, preamble
from p2p.messages import OutgoingMessage
from p2p.streams import Transport
from tests.p2p_helpers import MANIFEST, SWARM, make_frame, run, wait_until

pytestmark = pytest.mark.integration


def _transports(hosts) -> list[Transport]:
    return [Transport(h.p2p, h.identity, swarm=SWARM, manifest=MANIFEST) for h in hosts]


@asynccontextmanager
async def _a_to_b_through_f(tmp_path, p2p_cleanup, configure):
    """Hosts F, A and B with started transports (`configure(tf, ta, tb)` first); A sends to B
    through F, as a relayed address through F would have it."""
    async with p2p_cleanup.hosts(tmp_path, 3) as hosts:
        transports = _transports(hosts)
        configure(*transports)
        for t in transports:
            await t.start()
        transports[1].forward_through(hosts[2].peer_id, hosts[0].peer_id)
        try:
            yield hosts, transports
        finally:
            for t in transports:
                await t.stop()


def _async(predicate):
    async def checked():
        return predicate()
    return checked


def _strikes(transport: Transport) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    transport.counters.on_refusal_issued = lambda peer, reason: seen.append((peer, reason.name))
    return seen


def test_a_swap_and_a_push_forwarded_by_a_member_arrive_verified_as_the_origins(tmp_path, p2p_cleanup):
    rng = np.random.default_rng(0)
    mine, theirs = rng.standard_normal(300_000, dtype=np.float32), rng.standard_normal(300_000, dtype=np.float32)

    delivered = []

    async def reply(header):
        return OutgoingMessage.from_arrays("snapshot", header.round, {"w": theirs})

    async def deliver(message):
        delivered.append(message)

    def configure(tf, ta, tb):
        tb.on_swap("snapshot", reply, deliver=deliver, accept_round=lambda r: True)
        tb.on_push("note", deliver, accept_round=lambda r: True)

    async def scenario():
        async with _a_to_b_through_f(tmp_path, p2p_cleanup, configure) as ((f, a, b), (tf, ta, tb)):
            answer = await ta.swap(b.peer_id, OutgoingMessage.from_arrays("snapshot", 3, {"w": mine}))
            await ta.push(b.peer_id, OutgoingMessage.from_arrays("note", 3, {"w": mine[:10]}))
            assert np.array_equal(answer.arrays()["w"], theirs) and answer.sender == b.peer_id
            assert [m.sender for m in delivered] == [a.peer_id, a.peer_id]
            assert np.array_equal(delivered[0].arrays()["w"], mine)
            # every stream went through F, none directly from A to B (F counts a stream once both
            # ends have closed it)
            await wait_until(_async(lambda: tf.counters.forwarded_streams >= 2), 10.0, what="F to finish forwarding")
            assert tf.counters.forwarded_bytes > 2 * mine.nbytes
            assert ta.counters.paths.forwarded >= 2 and tb.counters.paths.forwarded >= 2
            assert b.peer_id.to_base58() not in ta.counters.paths.direct_by_peer
            assert not tb.counters.refused_incoming and not ta.counters.refused_outgoing
            # once the forwarding period is over, A tries its own connection again (a punched
            # hole, or here loopback): direct, and no longer forwarded
            ta.forward_through(b.peer_id, f.peer_id, seconds=0)
            await ta.push(b.peer_id, OutgoingMessage.from_arrays("note", 4, {"w": mine[:10]}))
            assert ta.counters.paths.direct_by_peer.get(b.peer_id.to_base58()) and len(delivered) == 3
            assert b.peer_id.to_bytes() not in ta._forward_via
    run(scenario(), timeout_s=90)


def test_a_forwarder_that_lies_about_the_origin_is_blamed_not_the_origin(tmp_path, p2p_cleanup):
    """A stream forwarded 'from C' carrying frames signed by the forwarder is refused BAD_SIGNATURE,
    and the strike goes to the forwarder: a forwarder cannot get an honest member banned."""
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 3) as (liar, c, b):
            tb = _transports((b,))[0]
            tb.on_push("note", lambda m: asyncio.sleep(0), accept_round=lambda r: True)
            strikes = _strikes(tb)
            await tb.start()
            _, reader, writer = await liar.p2p.call_binary_stream_handler(b.peer_id, FORWARDED_PROTOCOL)
            writer.write(preamble(c.peer_id))
            writer.write(make_frame(liar.identity, b.peer_id.to_bytes(), b"x" * 64))
            await writer.drain()
            await wait_until(_async(lambda: strikes), 10.0, what="b to refuse the forged stream")
            assert strikes == [(liar.peer_id.to_base58(), "BAD_SIGNATURE")]
            writer.close()
            await tb.stop()
    run(scenario(), timeout_s=60)


def test_a_member_behind_nat_forwards_for_no_one_and_the_sender_goes_its_own_way(tmp_path, p2p_cleanup):
    delivered = []

    async def deliver(message):
        delivered.append(message)

    def configure(tf, ta, tb):
        tb.on_push("note", deliver, accept_round=lambda r: True)
        tf.forwarder.enabled = False  # what join sets on a member behind NAT

    async def scenario():
        async with _a_to_b_through_f(tmp_path, p2p_cleanup, configure) as ((f, a, b), (tf, ta, tb)):
            await ta.push(b.peer_id, OutgoingMessage.from_arrays("note", 1, {"w": np.zeros(4, np.float32)}))
            # F offered no forwarding, so A sent on its own connection to B, and asks F again later
            assert [m.sender for m in delivered] == [a.peer_id]
            assert ta.counters.paths.direct_by_peer.get(b.peer_id.to_base58()) and not tb.counters.paths.forwarded
            assert tf.counters.forwarded_streams == 0 and f.peer_id.to_bytes() in ta._no_forward
            assert b.peer_id.to_bytes() not in ta._forward_via
    run(scenario(), timeout_s=60)


def test_a_forwarder_refuses_a_peer_outside_the_allowlist(tmp_path, p2p_cleanup):
    def configure(tf, ta, tb):
        tf.admit = {tf.p2p.peer_id.to_base58(), ta.p2p.peer_id.to_base58()}.__contains__  # b is not listed

    async def scenario():
        async with _a_to_b_through_f(tmp_path, p2p_cleanup, configure) as ((f, a, b), (tf, ta, tb)):
            with pytest.raises(RemoteRefused) as refused:
                await ta.push(b.peer_id, OutgoingMessage.from_arrays("note", 1, {"w": np.zeros(4, np.float32)}))
            assert refused.value.reason == Reason.NOT_ADMITTED and f"peer {b.peer_id}" in refused.value.detail
    run(scenario(), timeout_s=60)
