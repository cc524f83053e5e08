"""A timed transfer with a member (p2p/probe.py) between real peers, and doctor's use of it:
rates measured through the transport, and no probe makes a member send more than it received."""

from __future__ import annotations

import numpy as np
import pytest

from p2p.errors import RemoteRefused
from p2p.identity import NodeIdentity
from p2p.messages import OutgoingMessage
from p2p.probe import PROBE, PROBE_BYTES, measure_link, serve_probe
from p2p.streams import Transport
from tests.p2p_helpers import MANIFEST, SWARM, run

pytestmark = pytest.mark.integration


def test_a_member_answers_a_probe_with_as_many_bytes_as_it_received_and_no_more(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            prober = Transport(a.p2p, a.identity, swarm=SWARM, manifest=MANIFEST)
            member = Transport(b.p2p, b.identity, swarm=SWARM, manifest=MANIFEST)
            serve_probe(member)
            await prober.start()
            await member.start()
            try:
                measured = await measure_link(prober, b.peer_id)
                assert measured.nbytes == PROBE_BYTES and measured.peer == str(b.peer_id)
                assert measured.up_bps > 8 * 1e6 and measured.down_bps_at_least > 8 * 1e6  # loopback
                sent_before = member.counters.bytes_sent
                small = OutgoingMessage.from_arrays(PROBE, 0, {"zeros": np.zeros(1000, np.uint8)})
                reply = await prober.swap(b.peer_id, small, accept_round=lambda _r: True)
                assert len(reply.payload) == 1000  # as many as it carried
                assert member.counters.bytes_sent - sent_before < 1000 + 4096  # headers and status
                too_big = OutgoingMessage.from_arrays(PROBE, 0, {f"z{i}": np.zeros(PROBE_BYTES // 4, np.uint8)
                                                                 for i in range(5)})
                with pytest.raises(RemoteRefused):
                    await prober.push(b.peer_id, too_big)
                print(f"\nprobe on loopback: {measured.up_bps / 1e6:.0f} Mbit/s up, at least "
                      f"{measured.down_bps_at_least / 1e6:.0f} down")
            finally:
                await prober.stop()
                await member.stop()
    run(scenario(), timeout_s=120)


def test_doctor_measures_its_link_against_a_member_and_judges_the_swarms_rounds_by_it(tmp_path, p2p_cleanup):
    """probe_members as doctor's network check calls it: a reachable member that serves probes
    gives the rates its link finding judges (here a manifest of 1000-second steps: loopback
    carries it); an unreachable multiaddr is skipped."""
    from node.config.manifest import load_manifest
    from node.ops.doctor_link import LinkOptions, check_link, probe_members
    from node.rounds.message_sizes import transport_limits

    manifest = load_manifest("configs/swarms/local.toml")
    wire, limits = transport_limits(manifest, 256)

    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            member = Transport(b.p2p, b.identity, swarm=manifest.swarm.id, manifest=manifest.digest,
                               wire_limits=wire, limits=limits)
            serve_probe(member)
            await member.start()
            try:
                address = (await b.maddrs())[0]
                nobody = NodeIdentity.load_or_create(tmp_path / "nobody.key").peer_id  # no one runs it
                dead = f"/ip4/127.0.0.1/tcp/9/p2p/{nobody}"
                finding = await probe_members(a, manifest, a.identity, [dead, address], 5.0)
            finally:
                await member.stop()
        assert finding.level == "ok" and finding.measured is not None, finding.text
        assert finding.text.startswith(f"a timed transfer of 4.2 MB each way with member {str(b.peer_id)[-8:]}: ")
        judged = check_link(manifest, LinkOptions(step_seconds=1000.0), finding.measured)
        assert judged.level == "ok" and judged.text.startswith("this link (") and ", measured)" in judged.text
    run(scenario(), timeout_s=120)
