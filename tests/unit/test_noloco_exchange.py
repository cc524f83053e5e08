"""NoLoCoExchange's answer to a partner's swap, on the event loop, without a network.

A pair's initiator opens the swap as soon as it accepts; its accept travels on another stream,
so the swap can reach the proposer first. The proposer must hold the swap until its proposal is
answered, not refuse it (refusing left both nodes waiting the whole pair deadline).
"""

import asyncio
import random
from types import SimpleNamespace

import pytest

from node.contributions import BanList
from node.noloco_exchange import CONTROL_TIMEOUT_S, NoLoCoExchange
from p2p.errors import Refusal
from p2p.messages import OutgoingMessage
from protocol.matching import MatchMessage, MessageKind, ReadyAnnouncement

ME, PEER, STRANGER = "zz-me", "aa-peer", "bb-stranger"  # PEER's id is lower: it initiates


class Membership:
    def update(self, **fields) -> None:
        pass


def blocking_exchange(loop) -> NoLoCoExchange:
    ex = NoLoCoExchange(loop, None, Membership(), ME, "m", "blocking", 2, BanList(2, 60.0), 60.0,
                        30.0, random.Random(0), lambda kind, fields: None)
    ex.offered, ex.accepting = OutgoingMessage("noloco.snapshot", 0), True
    return ex


def propose_to_peer(ex: NoLoCoExchange) -> None:
    proposal = ex.matching.choose_candidate([ReadyAnnouncement(PEER, "m", 0)], random.Random(0))
    assert proposal is not None and proposal.recipient == PEER


def swap_from(peer: str):
    return SimpleNamespace(sender=peer)  # the header fields _snapshot_reply reads


def proposed_and_answered_soon(loop, answer: MessageKind) -> NoLoCoExchange:
    """An exchange that proposed to PEER, whose `answer` lands 50 ms from now."""
    ex = blocking_exchange(loop)
    propose_to_peer(ex)
    loop.call_later(0.05, ex._handle, MatchMessage(answer, PEER, ME, 0, 0, "m"))
    return ex


def test_a_swap_that_overtakes_the_accept_is_served_once_the_accept_lands():
    async def main():
        loop = asyncio.get_running_loop()
        ex = proposed_and_answered_soon(loop, MessageKind.ACCEPT)
        began = loop.time()
        reply = await ex._snapshot_reply(swap_from(PEER))
        assert reply is ex.offered and loop.time() - began < 1.0
        assert ex.matching.pair is not None and ex.matching.pair.partner == PEER
    asyncio.run(main())


def test_a_swap_from_a_peer_that_declines_is_refused_without_waiting_the_timeout():
    async def main():
        loop = asyncio.get_running_loop()
        ex = proposed_and_answered_soon(loop, MessageKind.DECLINE)
        began = loop.time()
        with pytest.raises(Refusal, match="not paired"):
            await ex._snapshot_reply(swap_from(PEER))
        assert loop.time() - began < CONTROL_TIMEOUT_S / 4
        assert ex._settling == []
    asyncio.run(main())


def test_a_swap_from_a_peer_we_never_proposed_to_is_refused_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        ex = blocking_exchange(loop)
        propose_to_peer(ex)
        began = loop.time()
        with pytest.raises(Refusal, match="not paired"):
            await ex._snapshot_reply(swap_from(STRANGER))
        assert loop.time() - began < 0.1
    asyncio.run(main())
