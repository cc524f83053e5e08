"""Equivocation is proof, and rounds are bounded (node/rounds/dilocox/evidence.py, bounds.py):
the exchange on the event loop without a network (tests/dilocox_parts.py), messages signed by
real keys."""

import asyncio
import dataclasses

import msgpack
import numpy as np
import pytest

from node.rounds.dilocox.bounds import AHEAD_ROUNDS
from node.rounds.dilocox.evidence import ENTRIES, EVIDENCE, SEEN, Proof, Version
from node.rounds.dilocox.sending import PGRAD
from node.rounds.state import round_bound
from p2p.errors import Reason, Refusal
from p2p.identity import NodeIdentity
from p2p.messages import OutgoingMessage, OutgoingTensor
from p2p.origin import ORIGIN, ORIGIN_DIGEST
from tests.dilocox_parts import exchange, member, relayed_copy
from tests.p2p_helpers import as_received, make_header


def swarm_of(loop, *identities, round_index=5):
    ex = exchange(loop, [member(i.peer_id.to_base58(), round_index) for i in identities])
    ex.first_round = round_index
    return ex


def evidence_from(sender: NodeIdentity, proof: Proof):
    return as_received(OutgoingMessage(EVIDENCE, proof.first.round, [], proof.meta()), sender)


def seen_from(sender: NodeIdentity, round_index: int, versions: list[Version]):
    data = np.frombuffer(msgpack.packb([[v.author, v.digest, v.signature] for v in versions]),
                         dtype=np.uint8)
    return as_received(OutgoingMessage(SEEN, round_index, [OutgoingTensor(ENTRIES, "uint8", data.shape, data)]),
                       sender)


def version(author: NodeIdentity, round_index: int, variant: int) -> Version:
    copy = relayed_copy(author, author, round_index, version=variant)
    return Version(author.peer_id.to_base58(), round_index, copy.meta[ORIGIN_DIGEST], copy.meta[ORIGIN])


def test_two_signed_versions_met_in_a_members_report_ban_the_author_and_drop_its_message():
    async def main():
        loop = asyncio.get_running_loop()
        liar, honest = NodeIdentity.generate(), NodeIdentity.generate()
        name = liar.peer_id.to_base58()
        ex = swarm_of(loop, liar, honest)
        ex._take_relayed(name, relayed_copy(liar, liar, 5))  # version 0 came to us
        assert name in ex.inbox[5]
        # the honest member was sent version 1 and says so
        await ex.evidence._on_seen(seen_from(honest, 5, [version(liar, 5, 1)]))
        assert ex.swarm.bans.is_banned(name) and name not in ex.inbox[5]
        assert ex.relay.store.get(5, name) is None
        await asyncio.sleep(0)  # the proof's pushes start
        sent = [(peer, m.kind) for peer, m in ex.transport.pushed]
        assert (honest.peer_id.to_base58(), EVIDENCE) in sent and all(p != name for p, _ in sent)
        # neither version is taken again
        ex._take_relayed(name, relayed_copy(liar, honest, 5, version=1))
        assert name not in ex.inbox[5]
    asyncio.run(main())


def test_a_push_whose_header_is_a_second_signed_version_is_proof_before_its_payload():
    async def main():
        loop = asyncio.get_running_loop()
        liar = NodeIdentity.generate()
        name = liar.peer_id.to_base58()
        ex = swarm_of(loop, liar)
        ex._take_relayed(name, relayed_copy(liar, liar, 5))
        again = relayed_copy(liar, liar, 5).meta  # the same version: held, no one struck
        with pytest.raises(Refusal) as refused:
            ex._check_head(make_header(liar, b"me", kind=PGRAD, round=5, meta=dict(again)))
        assert refused.value.reason is Reason.HELD and not ex.swarm.bans.is_banned(name)
        other = relayed_copy(liar, liar, 5, version=1).meta
        with pytest.raises(Refusal) as refused:
            ex._check_head(make_header(liar, b"me", kind=PGRAD, round=5, meta=dict(other)))
        assert refused.value.reason is Reason.BANNED and ex.swarm.bans.is_banned(name)
    asyncio.run(main())


@pytest.mark.parametrize("forgery", ["second unsigned", "same digest", "not an author"])
def test_a_forged_proof_bans_no_one_and_is_refused(forgery):
    async def main():
        loop = asyncio.get_running_loop()
        victim, forger = NodeIdentity.generate(), NodeIdentity.generate()
        ex = swarm_of(loop, victim, forger)
        real = version(victim, 5, 0)
        if forgery == "second unsigned":  # a digest the victim never signed, under its signature
            proof, reason = Proof(real, dataclasses.replace(real, digest=bytes(32))), Reason.BAD_SIGNATURE
        elif forgery == "same digest":
            proof, reason = Proof(real, real), Reason.MALFORMED
        else:  # the forger's own second version, presented as the victim's
            mine = version(forger, 5, 1)
            proof = Proof(real, dataclasses.replace(mine, author=real.author))
            reason = Reason.BAD_SIGNATURE
        with pytest.raises(Refusal) as refused:
            await ex.evidence._on_evidence(evidence_from(forger, proof))
        assert refused.value.reason is reason
        assert not ex.swarm.bans.is_banned(victim.peer_id.to_base58())
        # a report of a version its author did not sign is refused as well
        with pytest.raises(Refusal) as refused:
            await ex.evidence._on_seen(seen_from(forger, 5, [dataclasses.replace(real, digest=bytes(32))]))
        assert refused.value.reason is Reason.BAD_SIGNATURE
        assert not ex.swarm.bans.is_banned(victim.peer_id.to_base58())
    asyncio.run(main())


def test_a_proof_forwarded_by_a_member_bans_a_node_that_saw_one_version():
    async def main():
        loop = asyncio.get_running_loop()
        liar, witness = NodeIdentity.generate(), NodeIdentity.generate()
        ex = swarm_of(loop, liar, witness)
        await ex.evidence._on_evidence(evidence_from(witness, Proof(version(liar, 5, 0), version(liar, 5, 1))))
        assert ex.swarm.bans.is_banned(liar.peer_id.to_base58())
    asyncio.run(main())


def test_messages_and_claims_of_rounds_beyond_the_bound_are_refused_and_never_waited_for():
    async def main():
        loop = asyncio.get_running_loop()
        honest, liar = NodeIdentity.generate(), NodeIdentity.generate()
        name = liar.peer_id.to_base58()
        ex = exchange(loop, [member(honest.peer_id.to_base58(), 6), member(name, 10**9)])
        ex.first_round = 5
        ceiling = ex.bound.ceiling()
        assert ceiling == 6 + AHEAD_ROUNDS  # the majority's round (a lone liar cannot move it)
        ex._check_head(make_header(liar, b"me", kind=PGRAD, round=ceiling))  # near: taken
        with pytest.raises(Refusal) as refused:  # beyond the bound, honest-possible: no strike
            ex._check_head(make_header(liar, b"me", kind=PGRAD, round=ceiling + 1))
        assert refused.value.reason is Reason.REFUSED and "beyond round" in refused.value.detail
        assert not ex.swarm.bans.strikes.get(name)
        with pytest.raises(Refusal) as refused:  # beyond any honest round: a strike
            ex._check_head(make_header(liar, b"me", kind=PGRAD, round=round_bound(ceiling) + 1))
        assert refused.value.reason is Reason.REFUSED and len(ex.swarm.bans.strikes[name]) == 1
        # its record's claim leaves it out of every round's wait, and strikes it once
        assert name not in ex._rounds(5) and name not in ex._finished(5)
        assert name not in ex._rounds(6)
        assert ex.swarm.bans.is_banned(name)  # ban_after 2: the push and the claim
    asyncio.run(main())


def test_a_push_larger_than_the_manifests_codec_allows_is_refused_unread():
    async def main():
        loop = asyncio.get_running_loop()
        ex = swarm_of(loop, NodeIdentity.generate())
        ex.swarm.round_message_bytes = 1000
        assert ex._fits(1000) and not ex._fits(1001)
        ex.swarm.round_message_bytes = None  # unknown: the transport's bound only
        assert ex._fits(10**9)
    asyncio.run(main())
