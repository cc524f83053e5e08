"""A message of the last release on a real libp2p stream: the receiver (this release's
Transport on its own p2pd) refuses it WRONG_VERSION, counts the refusal like every other, and
answers the sender the sentence that names both versions. The peers are the fixtures' keys
(tests/fixtures/releases/write_fixtures.py), so the 0.1.0 frame's signature holds on the stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.config.manifest import load_manifest
from p2p.counters import TransportCounters
from p2p.framing import StreamIO
from p2p.identity import identity_path
from p2p.streams import STREAM_PROTOCOL, Transport
from tests.fixtures.releases.write_fixtures import fixture_identity
from tests.p2p_helpers import run, wait_until
from tests.unit.test_release_compatibility import EXPECTED, OURS

pytestmark = pytest.mark.integration
RELEASE = Path(__file__).resolve().parents[1] / "fixtures" / "releases" / "0.1.0"


def test_a_message_of_the_last_release_is_refused_counted_and_told(tmp_path, p2p_cleanup):
    meta = json.loads((RELEASE / "release.json").read_text())
    fixture_identity("lowcomm fixture recipient").save(identity_path(tmp_path / "node0"))
    fixture_identity("lowcomm fixture sender").save(identity_path(tmp_path / "node1"))

    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (receiver_host, sender_host):
            assert (receiver_host.peer_id.to_base58(), sender_host.peer_id.to_base58()) == \
                (meta["recipient"], meta["sender"])
            receiver = Transport(receiver_host.p2p, receiver_host.identity, swarm=OURS.swarm.id,
                                 manifest=load_manifest(RELEASE / "local.toml").digest)
            receiver.on_push("noloco/snapshot", _never_delivered, accept_round=lambda r: True)
            await receiver.start()
            try:
                _, reader, writer = await sender_host.p2p.call_binary_stream_handler(
                    receiver_host.peer_id, STREAM_PROTOCOL)
                try:
                    writer.write((RELEASE / "push.frame").read_bytes())
                    await writer.drain()
                    status = await StreamIO(reader, None, TransportCounters(), stall_s=10.0).read_status()
                finally:
                    writer.close()
                await wait_until(lambda: _counted(receiver), 5.0, what="the refusal counted")
                return status, dict(receiver.counters.refused_incoming)
            finally:
                await receiver.stop()
    (reason, detail), refused = run(scenario(), timeout_s=60)
    assert (reason.name, detail) == ("WRONG_VERSION", EXPECTED["0.1.0"])
    assert refused == {"WRONG_VERSION": 1}


async def _never_delivered(message) -> None:
    raise AssertionError("a message of another wire protocol was delivered")


async def _counted(transport: Transport) -> bool:
    return transport.counters.refused_incoming["WRONG_VERSION"] == 1
