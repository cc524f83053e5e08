"""The choice rules of node/daemon/state_quorum.py on hand-made member records and states."""

import torch

from node.daemon.state_quorum import (SPREAD_TOLERANCE, _Candidate, agreed_round, choose_agreed,
                                      quorum_digest)
from node.rounds.state import announcement, round_bound
from p2p.records import MemberRecord


def record(peer: str, round_index: int, digest: str = "", phi_round: int = -1) -> MemberRecord:
    extra = announcement(digest, phi_round, {}) if digest else {}
    return MemberRecord(peer, (), "dilocox", "m", round_index, "training", 0.0, extra)


def candidate(source: str, phi: torch.Tensor) -> _Candidate:
    return _Candidate(source, {"phi": {"w": phi}, "momentum": {"w": phi * 0}}, source, {})


def test_the_agreed_round_is_what_a_majority_reached_so_one_liar_stays_within_the_honest_rounds():
    assert agreed_round([]) == 0
    assert agreed_round([record("a", 7)]) == 7
    assert agreed_round([record("a", 10), record("b", 11), record("liar", 10**6)]) == 11
    assert agreed_round([record("a", 10), record("b", 11), record("liar", 0)]) == 10
    assert agreed_round([record("a", 10), record("b", 11), record("c", 12), record("liar", 10**6)]) == 11
    assert round_bound(11) < 10**6
    # nodes still joining have no say: three joiners arriving together do not outvote two members
    joiners = [MemberRecord(f"j{i}", (), "dilocox", "m", 0, "joining", 0.0) for i in range(3)]
    assert agreed_round([record("a", 10), record("b", 10), *joiners]) == 10


def test_a_digest_needs_a_majority_of_members_and_the_latest_such_round_wins():
    honest = [record("a", 11, "d10", 10), record("b", 11, "d10", 10)]
    assert quorum_digest([*honest, record("liar", 12, "evil", 11)]) == (10, "d10", ["a", "b"])
    assert quorum_digest([record("a", 11, "d10", 10), record("liar", 12, "evil", 11)]) is None
    # a minority at the same round loses; the holders are the majority's
    assert quorum_digest([*honest, record("liar", 11, "evil", 10)])[1:] == ("d10", ["a", "b"])


def test_noloco_adopts_a_state_a_majority_agrees_with_and_names_the_far_one():
    base = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    a, b = candidate("a", base + 0.01 * torch.randn(1000)), candidate("b", base + 0.01 * torch.randn(1000))
    far = candidate("liar", base + 0.8 * base.norm() / 1000**0.5 * torch.randn(1000))
    chosen, out = choose_agreed([a, far, b])
    assert chosen in (a, b) and [c.source for c, _ in out] == ["liar"] and out[0][1] > SPREAD_TOLERANCE
    # two states that disagree: neither is adopted (no single member decides)
    assert choose_agreed([a, far]) == (None, [])
    chosen, out = choose_agreed([a, b])
    assert chosen in (a, b) and out == []
    assert choose_agreed([a]) == (a, [])   # a swarm of one: nobody else to ask
