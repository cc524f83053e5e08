"""Refusals raised by the node's reply handlers count in its refused metrics (issue 24).

A reply handler's refusal fails the message before the stream's handler sees it, so the
transport never counted it: a node refusing swaps NOT_PAIRED, or state requests before its first
round, showed "refused: none". Real p2pd hosts, the real Transport, the node's own handlers.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from node.config.manifest import ProtocolSection
from node.daemon.run import serve_state
from node.rounds.noloco.exchange import SNAPSHOT, NoLoCoExchange
from node.rounds.state import STATE_KIND
from p2p.errors import Reason, RemoteRefused
from p2p.messages import OutgoingMessage
from p2p.streams import Transport
from tests.p2p_helpers import MANIFEST, SWARM, run
from tests.swarm_parts import unit_swarm

pytestmark = pytest.mark.integration


class NoStateYet:
    """A round policy before its first round: it has no state to serve (export_state's -1)."""

    def export_state(self, round_index=None):
        return -1, {}, ""

    def state_version(self, round_index=None):
        return -1, ""


def test_reply_handler_refusals_count_against_the_asker(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            ta = Transport(a.p2p, a.identity, swarm=SWARM, manifest=MANIFEST)
            tb = Transport(b.p2p, b.identity, swarm=SWARM, manifest=MANIFEST)
            loop = asyncio.get_running_loop()
            exchange = NoLoCoExchange(ProtocolSection(), unit_swarm(loop, peer_id=b.peer_id.to_base58(),
                                                                    transport=tb), random.Random(0))
            exchange.start(0)
            serve_state(SimpleNamespace(loop=loop, network=SimpleNamespace(transport=tb), worker=None),
                        NoStateYet())
            await ta.start()
            await tb.start()
            try:
                with pytest.raises(RemoteRefused) as refused:
                    await ta.swap(b.peer_id, OutgoingMessage(SNAPSHOT, 0))
                assert refused.value.reason is Reason.NOT_PAIRED
                with pytest.raises(RemoteRefused) as refused:
                    await ta.request(b.peer_id, STATE_KIND, 0)
                assert refused.value.reason is Reason.REFUSED
                counted = tb.counters.refused_incoming
                assert counted["NOT_PAIRED"] == 1 and counted["REFUSED"] == 1, dict(counted)
                assert tb.counters.refusals_by_peer == {a.peer_id.to_base58(): 2}
                # neither is misbehaviour: the asker is not struck
                assert not exchange.swarm.bans.strikes and not exchange.swarm.bans.refused_by_reason
            finally:
                await exchange.stop()
                await ta.stop()
                await tb.stop()
    run(scenario(), timeout_s=90)
