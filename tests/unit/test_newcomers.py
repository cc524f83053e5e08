"""The Sybil lever: new identities become eligible at admission.new_members_per_hour only."""

import pytest

from node.config.manifest import AdmissionSection
from node.config.schema import ConfigError, build_section
from node.daemon.members import MemberCache
from node.daemon.newcomers import NewcomerGate
from node.loop import BackgroundTasks
from node.rounds.contributions import BanList
from protocol.matching import DeclineReason, MatchingState, MatchMessage, MessageKind
from tests.swarm_parts import RecordedMembership, member


def test_the_first_view_is_admitted_then_newcomers_at_the_rate_in_the_order_first_seen():
    now = [0.0]
    gate = NewcomerGate(12.0, clock=lambda: now[0])  # burst 1, one every 300 s
    assert gate.admit([]) == set()  # an empty view is not the first view
    assert gate.admit(["a", "b"]) == {"a", "b"}
    assert gate.admit(["a", "b", "s2", "s1"]) == {"a", "b", "s1"}  # the burst: one, sorted
    now[0] = 299.0
    assert gate.admit(["a", "b", "s1", "s2", "s3"]) == {"a", "b", "s1"}
    now[0] = 301.0
    assert gate.admit(["a", "b", "s1", "s2", "s3"]) == {"a", "b", "s1", "s2"}
    now[0] = 10_000.0  # tokens are capped at the burst: one, not 32
    assert gate.admit(["a", "b", "s1", "s2", "s3", "s4"]) == {"a", "b", "s1", "s2", "s3"}
    assert gate.is_admitted("s3") and not gate.is_admitted("s4")


def test_the_gate_remembers_a_bounded_number_of_identities():
    gate = NewcomerGate(1.0, clock=lambda: 0.0, remember=3)
    gate.admit(["a"])
    gate.admit([f"s{i}" for i in range(100)])
    assert len(gate.waiting) <= 3 and len(gate.admitted) <= 3


def test_a_gate_of_zero_is_refused_and_the_manifest_key_is_validated():
    with pytest.raises(ValueError, match="must be > 0"):
        NewcomerGate(0.0)
    with pytest.raises(ConfigError, match="admission.new_members_per_hour"):
        build_section(AdmissionSection, {"new_members_per_hour": -1}, "admission.")
    assert AdmissionSection().new_members_per_hour == 0.0


def test_the_member_cache_holds_back_newcomers_and_the_matching_declines_their_proposals():
    now = [0.0]
    gate = NewcomerGate(12.0, clock=lambda: now[0])
    cache = MemberCache(RecordedMembership(), BackgroundTasks(), manifest="m", bans=BanList(2, 60.0),
                        refresh_s=1.0, gate=gate)
    cache.records = {p: member(p, 0) for p in ("a", "b")}
    assert {r.peer_id for r in cache.eligible()} == {"a", "b"}
    cache.records.update({p: member(p, 0) for p in ("s1", "s2")})
    assert {r.peer_id for r in cache.eligible()} == {"a", "b", "s1"}
    state = MatchingState("me", "m", 0, admitted=cache.admitted)
    answer = state.handle(MatchMessage(MessageKind.PROPOSE, "s2", "me", 0, 0, "m"))
    assert [(m.kind, m.reason) for m in answer] == [(MessageKind.DECLINE, DeclineReason.INELIGIBLE)]
    assert state.handle(MatchMessage(MessageKind.PROPOSE, "s1", "me", 0, 0, "m"))[0].kind \
        is MessageKind.ACCEPT
