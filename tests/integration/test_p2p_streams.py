"""Signed exchanges between real peers: swap, push, request, refusals, limits, cancellation."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import numpy as np
import pytest

from p2p.errors import Reason, Refusal, RemoteRefused, ReplyRejected, TransferFailed, TransferTimeout
from p2p.limits import TransferLimits
from p2p.messages import OutgoingMessage
from p2p.progress import NeedBy
from p2p.streams import Transport
from tests.p2p_helpers import MANIFEST, SWARM, run, wait_until

pytestmark = pytest.mark.integration
MB = 10**6


def transports(a, b, limits_a=TransferLimits(), limits_b=TransferLimits()):
    return (Transport(a.p2p, a.identity, swarm=SWARM, manifest=MANIFEST, limits=limits_a),
            Transport(b.p2p, b.identity, swarm=SWARM, manifest=MANIFEST, limits=limits_b))


async def settled(transport: Transport) -> bool:
    return transport._ledger.total_bytes == 0 and not transport._assemblies


def test_100_mb_swap_arrives_bit_exact_and_verified(tmp_path, p2p_cleanup):
    rng = np.random.default_rng(4)
    # Two tensors each way, one of them bf16 bits, 100 MB in all per direction.
    mine = {"w": rng.standard_normal(40 * MB // 4, dtype=np.float32),
            "b": rng.integers(0, 2**16, 60 * MB // 2, dtype=np.uint16)}
    theirs = {"w": rng.standard_normal(40 * MB // 4, dtype=np.float32),
              "b": rng.integers(0, 2**16, 60 * MB // 2, dtype=np.uint16)}

    def message(arrays, round):
        out = OutgoingMessage.from_arrays("snapshot", round, {"w": arrays["w"]}, meta={"loss": 2.5})
        from p2p.messages import OutgoingTensor
        out.tensors = [*out.tensors, OutgoingTensor("b", "bfloat16", arrays["b"].shape, arrays["b"])]
        return out

    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = transports(a, b)
            received_by_b = []

            async def reply(header):
                assert header.round == 7 and header.meta == {"loss": 2.5}
                return message(theirs, 8)

            async def deliver(incoming):
                received_by_b.append(incoming)
            tb.on_swap("snapshot", reply, deliver=deliver, accept_round=lambda r: abs(r - 8) <= 2)
            await ta.start()
            await tb.start()
            started = time.perf_counter()
            answer = await ta.swap(b.peer_id, message(mine, 7), accept_round=lambda r: r == 8)
            elapsed = time.perf_counter() - started
            for got, expected, peer in ((answer, theirs, b), (received_by_b[0], mine, a)):
                arrays = got.arrays()
                assert got.sender == peer.peer_id
                assert [t.name for t in got.tensors] == ["w", "b"] and got.tensors[1].dtype == "bfloat16"
                assert np.array_equal(arrays["w"], expected["w"]) and np.array_equal(arrays["b"], expected["b"])
            assert answer.round == 8 and len(answer.payload) == 100 * MB
            for side in (ta, tb):
                counters = side.counters
                assert counters.messages_verified == 1 and counters.frames_received == 12
                assert counters.bytes_sent > 100 * MB and counters.bytes_received > 100 * MB
                assert not counters.refused_incoming and not counters.refused_outgoing
            await wait_until(lambda: settled(tb), 5.0, what="b released its buffers")
            await ta.stop()
            await tb.stop()
            print(f"\n100 MB swap (both directions at once, 4 streams): {elapsed:.2f} s, "
                  f"{100 * MB / elapsed / 1e6:.0f} MB/s per direction")
    run(scenario(), timeout_s=120)


def test_push_request_and_every_refusal_raise_clearly_on_the_sender(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = transports(a, b, limits_b=TransferLimits(max_inflight_bytes_per_peer=2 * MB,
                                                              reply_timeout_s=1.0))
            pushed = []

            async def deliver(message):
                if message.meta.get("refuse"):
                    raise Refusal(Reason.REFUSED, "not today")
                if message.meta.get("slow"):
                    await asyncio.sleep(30)
                pushed.append(message)

            async def state(header):
                if header.meta.get("missing"):
                    raise Refusal(Reason.REFUSED, "no state yet")
                return OutgoingMessage.from_arrays("state", 9, {"phi": np.arange(3 * MB // 4, dtype=np.float32)},
                                                   meta={"digest": "abc"})
            tb.on_push("grad", deliver, accept_round=lambda r: r >= 5)
            finished = []  # the transport's word that a request's exchange is over, once each

            async def finished_reach(count):
                return len(finished) >= count
            tb.on_request("state", state, accept_round=lambda r: True,
                          finished=lambda h: finished.append((h.sender, h.meta)))
            await ta.start()
            await tb.start()

            small = OutgoingMessage.from_arrays("grad", 5, {"g": np.ones(10, dtype=np.float16)})
            await ta.push(b.peer_id, small)
            assert np.array_equal(pushed[-1].arrays()["g"], np.ones(10, dtype=np.float16))
            reply = await ta.request(b.peer_id, "state", 9, streams=4)
            assert reply.meta == {"digest": "abc"} and reply.arrays()["phi"][-1] == 3 * MB // 4 - 1
            await wait_until(lambda: finished_reach(1), 5.0, what="b's word that the request is over")
            assert finished == [(a.peer_id.to_bytes(), {})]

            cases = [
                (OutgoingMessage("grad", 4, small.tensors), Reason.STALE_ROUND),
                (OutgoingMessage("nope", 5, small.tensors), Reason.UNSUPPORTED),
                (OutgoingMessage("grad", 5, small.tensors, {"refuse": True}), Reason.REFUSED),
                (OutgoingMessage("grad", 5, small.tensors, {"slow": True}), Reason.TIMEOUT),
                (OutgoingMessage.from_arrays("grad", 5, {"g": np.zeros(3 * MB, np.uint8)}), Reason.NO_ROOM),
            ]
            for message, reason in cases:
                with pytest.raises(RemoteRefused) as refused:
                    await ta.push(b.peer_id, message)
                assert refused.value.reason == reason, (message.meta, refused.value)
                assert str(refused.value).startswith(f"peer {b.peer_id} refused our {message.kind!r} message: "
                                                     f"{reason.name}")
            with pytest.raises(RemoteRefused, match="REFUSED.*no state yet"):
                await ta.request(b.peer_id, "state", 9, meta={"missing": True})
            await wait_until(lambda: finished_reach(2), 5.0, what="the refused request is over too")
            assert finished[1] == (a.peer_id.to_bytes(), {"missing": True})
            assert tb.counters.refused_incoming["STALE_ROUND"] == 1
            assert ta.counters.refused_outgoing["NO_ROOM"] == 1
            await wait_until(lambda: settled(tb), 5.0, what="b released its buffers")
            await ta.stop()
            await tb.stop()
    run(scenario(), timeout_s=90)


def test_cancel_and_timeout_release_every_buffer(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = transports(a, b, limits_b=TransferLimits(stall_s=2.0))

            async def deliver(message):
                pass
            tb.on_push("grad", deliver, accept_round=lambda r: True)
            await ta.start()
            await tb.start()
            payload = OutgoingMessage.from_arrays("grad", 1, {"g": np.zeros(200 * MB, np.uint8)})
            sending = asyncio.create_task(ta.push(b.peer_id, payload))
            await wait_until(lambda: _receiving(tb), 10.0, interval_s=0.01, what="transfer under way")
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            await wait_until(lambda: settled(tb), 10.0, what="receiver released the cancelled message")

            with pytest.raises(TransferTimeout, match="could not finish 200 MB within 0.05 s"):
                await ta.push(b.peer_id, payload, need_by=NeedBy(0.05, "0.05 s"))
            await wait_until(lambda: settled(tb), 10.0, what="receiver released the timed-out message")

            stranger = "12D3KooWNvSZnPi3RrhrTwEY4LuuBeB6K6facKUCJcyWG1aoDd2p"
            with pytest.raises(TransferFailed, match="could not open a stream"):
                await ta.push(stranger, payload)
            await ta.push(b.peer_id, payload)  # and the link still works
            await ta.stop()
            await tb.stop()
    run(scenario(), timeout_s=90)


async def _receiving(transport: Transport) -> bool:
    return transport._ledger.total_bytes > 0


def test_simultaneous_swaps_both_ways_and_a_rejected_reply(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = transports(a, b)
            for transport, value in ((ta, 1.0), (tb, 2.0)):
                async def reply(header, value=value):
                    return OutgoingMessage.from_arrays("snapshot", 4, {"x": np.full(MB, value, np.float32)})
                transport.on_swap("snapshot", reply, accept_round=lambda r: True)
                await transport.start()
            mine = OutgoingMessage.from_arrays("snapshot", 4, {"x": np.zeros(MB, np.float32)})
            # Both nodes propose to each other at the same moment (NoLoCo's simultaneous proposals).
            from_b, from_a = await asyncio.gather(ta.swap(b.peer_id, mine), tb.swap(a.peer_id, mine))
            assert from_b.arrays()["x"][0] == 2.0 and from_a.arrays()["x"][0] == 1.0

            with pytest.raises(ReplyRejected) as rejected:
                await ta.swap(b.peer_id, mine, accept_round=lambda r: r > 4)
            assert rejected.value.reason == Reason.STALE_ROUND and "round 4" in str(rejected.value)
            await wait_until(lambda: _told(tb, "STALE_ROUND"), 5.0, what="b told of the rejection")
            await wait_until(lambda: settled(ta), 5.0, what="a released the rejected reply")
            await ta.stop()
            await tb.stop()
    run(scenario(), timeout_s=60)


async def _told(transport: Transport, reason: str) -> bool:
    return transport.counters.refused_outgoing[reason] > 0


def test_a_declared_size_the_kind_rules_out_is_refused_before_its_payload_is_read(tmp_path, p2p_cleanup):
    """A NoLoCo snapshot has exactly the receiver's own snapshot's bytes: a header declaring
    another size is refused (TOO_LARGE, a strike) on either side of a swap before any payload."""
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = transports(a, b)

            async def reply(header):
                return OutgoingMessage.from_arrays("snapshot", 4, {"x": np.ones(MB, np.float32)})
            tb.on_swap("snapshot", reply, accept_round=lambda r: True, accept_bytes=lambda n: n == 4 * MB)
            await ta.start()
            await tb.start()
            lying = OutgoingMessage.from_arrays("snapshot", 4, {"x": np.zeros(2 * MB, np.float32)})
            with pytest.raises(RemoteRefused) as refused:
                await ta.swap(b.peer_id, lying)
            assert refused.value.reason == Reason.TOO_LARGE and "declaring 8000000 payload bytes" in str(refused.value)
            assert tb.counters.refused_incoming["TOO_LARGE"] == 1
            honest = OutgoingMessage.from_arrays("snapshot", 4, {"x": np.zeros(MB, np.float32)})
            assert (await ta.swap(b.peer_id, honest, accept_bytes=lambda n: n == 4 * MB)).arrays()["x"][0] == 1.0
            with pytest.raises(ReplyRejected) as rejected:  # the reply's size is ruled out this time
                await ta.swap(b.peer_id, honest, accept_bytes=lambda n: n == 2 * MB)
            assert rejected.value.reason == Reason.TOO_LARGE
            await wait_until(lambda: settled(ta), 5.0, what="a released the rejected reply")
            await wait_until(lambda: settled(tb), 5.0, what="b released its buffers")
            await ta.stop()
            await tb.stop()
    run(scenario(), timeout_s=60)


def test_a_reply_refused_while_the_message_streams_in_reaches_the_sender_as_a_reason(tmp_path, p2p_cleanup,
                                                                                    caplog):
    """The replier refuses its own reply while the sender's frames still arrive (here: b takes
    the connection for a relayed one, whose limit the reply crosses, as behind NAT): its status
    must reach the sender, not a reset from closing with the sender's bytes unread while this
    stream's frame reader still held it (the NAT test saw BrokenPipe instead of the reason)."""
    from p2p.paths import RelayLimits

    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = transports(a, b)
            tb.counters.paths.note = lambda peer, maddr: True  # fault injection: every stream "relayed"
            tb.relay_limits = RelayLimits(max_bytes=MB)

            async def reply(header):
                return OutgoingMessage.from_arrays("snapshot", 4, {"x": np.zeros(MB, np.float32)})
            tb.on_swap("snapshot", reply, accept_round=lambda r: True)
            await ta.start()
            await tb.start()
            large = OutgoingMessage.from_arrays("snapshot", 4, {"x": np.zeros(8 * MB, np.float32)})
            for _ in range(10):
                with pytest.raises(RemoteRefused) as refused:
                    await ta.swap(b.peer_id, large, streams=3)
                assert refused.value.reason == Reason.TOO_LARGE and "would cross a circuit relay" \
                    in str(refused.value), refused.value
            await ta.stop()
            await tb.stop()
    caplog.set_level(logging.ERROR, logger="asyncio")
    run(scenario(), timeout_s=90)
    gc.collect()  # a task whose error nobody retrieved says so when it is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text
