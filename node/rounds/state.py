"""The outer state a member serves (what a late joiner downloads, and a diverged DiLoCoX node
too), and the digest of φ it announces in its member record to verify that state against.

A state message (kind STATE_KIND) carries φ as "phi/<name>" and the outer momentum as
"momentum/<name>", in fp32, and in its signed header the round it belongs to ("phi_round"), the
digest of φ ("phi") and the server's current round ("round"). A requester may ask for the state
after a given round (meta "phi_round"); DiLoCoX members keep the last two.

Encoding and decoding copy and hash whole models: callers run them off the event loop
(`loop.run_in_executor`).

The announcement (`announcement`, kept current by node/daemon/members.py PhiAnnouncer) holds the
digest of φ after the member's latest round and the one before it: a member a round ahead still
shows the digest of the round another node compares or downloaded (`announced_phi`).
"""

from __future__ import annotations

from typing import Any

import torch

from node.rounds.wire_tensors import from_wire, to_wire
from p2p.records import MemberRecord
from protocol.tensors import weights_digest

STATE_KIND = "state"
GROUPS = ("phi", "momentum")


def encode_state(groups: dict[str, dict[str, torch.Tensor]]) -> list:
    return [t for group in GROUPS for t in to_wire(groups[group], "fp32", f"{group}/")]


def announcement(digest: str, round_index: int, previous: dict[str, Any]) -> dict[str, Any]:
    """The member record fields announcing φ's `digest` after `round_index`; `previous` is the
    record's fields before (its latest announcement becomes the one before)."""
    return {"phi": digest, "phi_round": round_index, "phi_prev": previous.get("phi", ""),
            "phi_prev_round": previous.get("phi_round", -1)}


def announced_phi(extra: dict[str, Any], round_index: int) -> str | None:
    """A member's announced φ digest after `round_index`: its latest, or the one before."""
    for digest, announced in (("phi", "phi_round"), ("phi_prev", "phi_prev_round")):
        if extra.get(announced) == round_index and isinstance(extra.get(digest), str):
            return extra[digest]
    return None


def phi_holders(members: list, round_index: int) -> dict[str, list[str]]:
    """The members (MemberRecords) announcing a φ digest after `round_index`, by digest, in
    the members' order."""
    holders: dict[str, list[str]] = {}
    for r in members:
        if digest := announced_phi(r.extra, round_index):
            holders.setdefault(digest, []).append(r.peer_id)
    return holders


# How far an honest member's round can run ahead of the rounds known to have passed (the
# majority's, or as many as this node could have trained since it started): 4x, plus 16.
LEAD_FACTOR, LEAD_ROUNDS = 4, 16


def round_bound(rounds_passed: float) -> int:
    """The highest round an honest member can claim while `rounds_passed` rounds are known."""
    return int(LEAD_FACTOR * rounds_passed) + LEAD_ROUNDS


def majority(count: int) -> int:
    return count // 2 + 1


def settled(members: list[MemberRecord]) -> list[MemberRecord]:
    """Members past their own join: a node still joining (status "joining", round 0) holds no
    state and has no say, so that joiners arriving together do not outvote the running swarm."""
    return [r for r in members if r.status != "joining"]


def agreed_round(members: list[MemberRecord]) -> int:
    """The highest round a majority of the settled `members` reached (0 for none): a minority of
    liars keeps it within the honest members' rounds (the round a late joiner starts at, and the
    one a DiLoCoX node that fell behind catches up to)."""
    rounds = sorted((r.round for r in settled(members)), reverse=True)
    return rounds[majority(len(rounds)) - 1] if rounds else 0


def decode_state(received: Any) -> tuple[dict[str, dict[str, torch.Tensor]], str]:
    """({"phi": φ, "momentum": ...} in fp32, the digest of φ as received). The tensors are views
    of the received message's buffer, not copies (a model-sized state is held once): callers
    only read them, and adopting one copies out of them (protocol/noloco.py, protocol/diloco.py
    load_state_dict; InnerTrainer.load_parameters)."""
    groups = {group: from_wire(received, f"{group}/", share=True) for group in GROUPS}
    return groups, weights_digest(groups["phi"])
