"""Transport limits between real peers (real p2pd): a message refused for room or size is one
refusal, whatever its stream count, and room is never held against the sender; a reply over the
bound is refused with its reason; a swarm whose messages cannot fit stops before it starts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from node.rounds.contributions import BanList
from p2p.errors import Reason, RemoteRefused
from p2p.limits import TransferLimits, WireLimits
from p2p.messages import OutgoingMessage
from p2p.streams import Transport
from tests.p2p_helpers import MANIFEST, SWARM, run

pytestmark = pytest.mark.integration
MB = 10**6
STREAMS = 4


def striking(transport: Transport) -> BanList:
    """The daemon's wiring (node/daemon/join.py): refusals the transport issues strike their
    sender, a misbehaving one is banned after two."""
    bans = BanList(ban_after=2, ban_seconds=600.0)
    transport.counters.on_refusal_issued = \
        lambda peer, reason: bans.transport_refusal(peer, reason.name, transport.ban)
    return bans


def big(kind: str = "grad") -> OutgoingMessage:
    return OutgoingMessage.from_arrays(kind, 1, {"g": np.zeros(3 * MB, np.uint8)})


async def started(a, b, wire_b=WireLimits(), limits_b=TransferLimits()):
    ta = Transport(a.p2p, a.identity, swarm=SWARM, manifest=MANIFEST)
    tb = Transport(b.p2p, b.identity, swarm=SWARM, manifest=MANIFEST, wire_limits=wire_b, limits=limits_b)
    return ta, tb


def test_a_message_refused_for_room_is_one_refusal_and_no_strike(tmp_path, p2p_cleanup):
    """Each of a message's streams was refused BUSY and struck: one refused 4-stream swap banned
    an honest peer."""
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = await started(a, b, limits_b=TransferLimits(max_inflight_bytes_per_peer=2 * MB))
            bans = striking(tb)
            delivered = []

            async def deliver(message):
                delivered.append(message)
            tb.on_push("grad", deliver, accept_round=lambda r: True)
            await ta.start()
            await tb.start()
            for _ in range(2):
                with pytest.raises(RemoteRefused) as refused:
                    await ta.push(b.peer_id, big(), streams=STREAMS)
                assert refused.value.reason is Reason.NO_ROOM, refused.value
            assert dict(tb.counters.refused_incoming) == {"NO_ROOM": 2}
            assert bans.strikes == {} and bans.banned() == []
            small = OutgoingMessage.from_arrays("grad", 1, {"g": np.ones(10, np.uint8)})
            await ta.push(b.peer_id, small)  # not banned
            assert len(delivered) == 1
            await ta.stop()
            await tb.stop()
    run(scenario(), timeout_s=90)


def test_a_message_of_a_size_the_receiver_rules_out_is_struck_once_not_once_per_stream(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = await started(a, b)
            bans = striking(tb)

            async def deliver(message):
                pass
            tb.on_push("grad", deliver, accept_round=lambda r: True, accept_bytes=lambda n: n == 1000)
            await ta.start()
            await tb.start()
            with pytest.raises(RemoteRefused) as refused:
                await ta.push(b.peer_id, big(), streams=STREAMS)
            assert refused.value.reason is Reason.TOO_LARGE
            assert dict(tb.counters.refused_incoming) == {"TOO_LARGE": 1}
            assert [len(times) for times in bans.strikes.values()] == [1] and bans.banned() == []
            await ta.stop()
            await tb.stop()
    run(scenario(), timeout_s=90)


def test_a_reply_over_the_bound_is_refused_with_its_reason_not_internal(tmp_path, p2p_cleanup):
    """A `medium` state server answered INTERNAL: its reply's send plan raised ValueError."""
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta, tb = await started(a, b, wire_b=WireLimits(max_message_bytes=1 * MB))

            async def state(header):
                return big("state")
            tb.on_request("state", state, accept_round=lambda r: True)
            await ta.start()
            await tb.start()
            with pytest.raises(RemoteRefused) as refused:
                await ta.request(b.peer_id, "state", 0, streams=STREAMS)
            assert refused.value.reason is Reason.REFUSED
            assert f"the 'state' message of {3 * MB} bytes was not sent: it exceeds the {MB}-byte bound" \
                in refused.value.detail
            await ta.stop()
            await tb.stop()
    run(scenario(), timeout_s=90)


def test_a_swarm_whose_messages_cannot_fit_the_transport_stops_at_start_in_one_sentence(tmp_path):
    """1024 layers: the state's 12294 tensors cannot be listed in one frame header. The node
    says so before it starts p2pd or builds its model."""
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", "join", "--swarm", "local", "--data-dir", str(tmp_path / "n"),
         "--listen", "/ip4/127.0.0.1/tcp/0", "--set", "model.n_layers=1024", "--set", "model.dim=8",
         "--set", "model.n_heads=1", "--set", "model.ffn_hidden=8"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lowcomm-node: error: the late-join state (φ and outer momentum in fp32) has "
                           "12294 tensors"), proc.stderr[-2000:]
    assert "swarm 'local' cannot run here; choose a smaller model" in last
    assert "p2pd" not in proc.stderr and "joined" not in proc.stderr
