"""Issue 8: adversaries as real nodes among honest ones (NoLoCo, loopback, real p2pd).

Each adversary is a real daemon run through tests/adversary.py with one misbehaviour patched in.
Asserted from what the honest daemons write (metrics.jsonl, node.log): the contribution is
refused with the right reason, the sender is banned after `contributions.ban_after` offences,
and the honest nodes keep training and swapping with each other.
"""

import time

import pytest

from tests.faults import FaultHarness, adversary_manifest, finished, joined, start_swarm, stop_all
from tests.swarm_harness import assert_phi_heals

pytestmark = pytest.mark.integration

REFUSAL_TEXT = {"nan": "holds NaN or Inf", "scale": "more than 10x", "noise": "below the noise floor"}


def swapped_with(peer: str, after: float):
    return lambda ev: any(e["event"] == "swapped" and e["partner"] == peer and e["time"] > after
                          for e in ev)


def refused_as_banned(by) -> str:
    """What the adversary logs when `by`, having banned it, refuses one of its streams."""
    return f"peer {by.peer_id} refused our 'noloco.match' message: BANNED"


def wait_any_log(nodes, text: str, timeout: float):
    """(node, log) of the first node whose log holds `text`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            log = node.log_tail(100_000)
            if text in log:
                return node, log
        time.sleep(0.2)
    tails = "\n---\n".join(n.log_tail() for n in nodes)
    raise AssertionError(f"no node logged {text!r} within {timeout} s:\n{tails}")


# Inf takes the same finite check as NaN (tests/unit/test_contributions.py covers both): one
# daemon run for the two keeps the suite within CI's time.
@pytest.mark.parametrize("kind", ["nan", "scale", "noise"])
def test_poisoned_updates_are_refused_and_the_sender_banned(harness_factory, kind):
    harness = harness_factory(adversary_manifest(f"t-adv-{kind}", alignment_check=kind == "noise"),
                              harness_class=FaultHarness)
    honest, bad = start_swarm(harness, 2, kind)
    bad_id = bad.peer_id
    banner, _ = wait_any_log(honest, f"banned {bad_id}", 180)
    banned_at = time.time()
    # the ban is logged as the refusal happens; the round event that reports it follows
    banner.wait_for(lambda ev: sum(e["event"] == "round" and bool(e.get("refused"))
                                   for e in ev) >= 2, 30, "the refusals' round events")
    # every refusal names the adversary and the right check; none names an honest node
    refused = [s for n in honest for r in n.events("round") for s in r.get("refused") or []]
    assert len([s for s in refused if bad_id in s]) >= 2, refused
    assert all(bad_id in s and REFUSAL_TEXT[kind] in s for s in refused), refused
    assert "adversary: offering" in bad.log_tail(100_000)
    # a refused contribution never reaches the outer step: the honest nodes keep learning
    # from each other after the ban
    other = next(n for n in honest if n is not banner)
    banner.wait_for(swapped_with(other.peer_id, banned_at), 120,
                    "a swap with the honest peer after the ban")
    # after the ban the adversary's streams are refused before their payload is read
    wait_any_log([bad], refused_as_banned(banner), 90)
    stop_all([*honest, bad])
    assert banner.events("transport")[-1]["refused_incoming"].get("BANNED", 0) >= 1
    for node in honest:
        assert finished(node.events())


def test_replayed_messages_are_refused_as_replayed(harness_factory):
    """The adversary sends each peer, after every message, the first signed message of the
    same kind again, byte for byte: the replay guard refuses it (REPLAYED), and repeated
    replays ban the sender (its streams are then refused BANNED)."""
    harness = harness_factory(adversary_manifest("t-adv-replay"), harness_class=FaultHarness)
    honest, bad = start_swarm(harness, 2, "replay")
    wait_any_log([bad], "refused: REPLAYED", 120)
    banner, _ = wait_any_log(honest, f"banned {bad.peer_id}", 120)
    attacked_at = time.time()
    a, b = honest
    a.wait_for(swapped_with(b.peer_id, attacked_at), 120, "an honest swap during the replays")
    wait_any_log([bad], refused_as_banned(banner), 90)  # banned: its streams are refused
    stop_all([*honest, bad])
    assert "was ACCEPTED" not in bad.log_tail(100_000)
    assert sum(n.events("transport")[-1]["refused_incoming"].get("REPLAYED", 0)
               for n in honest) >= 1
    assert banner.events("transport")[-1]["refused_incoming"].get("BANNED", 0) >= 1


def test_streams_never_finished_do_not_stop_honest_exchanges(harness_factory):
    """The adversary holds 16+ silent streams to every member (the per-peer limit); its extra
    streams are refused BUSY, which bans it, and the victims keep swapping with the honest node
    meanwhile."""
    harness = harness_factory(adversary_manifest("t-adv-stall"), harness_class=FaultHarness)
    extra = ["--min-peers", "1"]
    victim = harness.start_node(0, extra=extra)
    victim.wait_for(joined, 90, "joining")
    other = harness.start_node(1, [victim.address], extra)
    other.wait_for(joined, 90, "joining")
    # The attack starts once the honest pair trains. Started beside them (start_swarm, each
    # waiting for 2 members, the attacker counted), it got the attacker banned before the victim
    # had seen the others in 3 of 9 runs, and the victim waited out its 120 s min-peers timeout
    # for a second eligible member: the node as designed (a banned member is not eligible), the
    # test's race (it was blamed on the DHT, whose lookups did find all three records).
    victim.wait_for(swapped_with(other.peer_id, 0), 120, "a first honest swap")
    bad = harness.start_node(2, [victim.address], extra, adversary="stall")
    honest = [victim, other]
    wait_any_log([bad], f"silent streams to {victim.peer_id}", 120)
    attacked_at = time.time()
    victim.wait_for(swapped_with(other.peer_id, attacked_at), 45,
                    "an honest swap while the silent streams are held")
    assert bad.process.poll() is None  # the attack was live during that swap
    stop_all([*honest, bad])
    refused = victim.events("transport")[-1]["refused_incoming"]
    print("victim refusals under the stall attack:", refused)
    assert refused.get("BUSY", 0) >= 1, refused
    assert f"banned {bad.peer_id}" in victim.log_tail(1_000_000)
    assert "refused streams (last: BUSY)" in victim.log_tail(1_000_000)


def test_a_dht_flood_of_fake_members_does_not_stop_honest_pairing(harness_factory):
    """30 ghost members (validly signed by fresh keys, 'ready', unreachable) and forged
    tombstones of the real members: the forgeries are refused by the owner-only validator and
    get their sender banned, the ghosts cost failed proposals, and the honest nodes still pair
    with each other."""
    harness = harness_factory(adversary_manifest("t-adv-flood"), harness_class=FaultHarness)
    honest, bad = start_swarm(harness, 2, "flood")
    wait_any_log([bad], "adversary: flood stored", 60)
    flooded_at = time.time()
    a, b = honest
    a.wait_for(swapped_with(b.peer_id, flooded_at), 150, "an honest swap during the flood")
    log = bad.log_tail(100_000)
    last = [line for line in log.splitlines() if "adversary: flood stored" in line][-1]
    assert "0 forged tombstones accepted" in last, last
    for node in honest:
        node.wait_log(f"banned {bad.peer_id}", 60)
    assert "not signed by the member it names" in a.log_tail(100_000)
    stop_all([*honest, bad])
    for node in honest:
        rounds = [r for r in node.events("round") if r["time"] > flooded_at]
        paired = sum(bool(r["partner"]) for r in rounds)
        print(f"node {node.index}: {paired}/{len(rounds)} rounds paired during the flood; {last}")
        # a swap, not a round: the round that applies the last swap may end after the stop
        assert any(e["event"] == "swapped" and e["time"] > flooded_at for e in node.events()), \
            f"node {node.index} never swapped during the flood"


def test_dilocox_nan_pseudo_gradients_are_refused_and_honest_phi_agrees(harness_factory):
    """DiLoCoX (bf16 codec): the adversary's NaN pseudo-gradient reaches the whole group every
    round; both honest nodes refuse it, ban its sender, and still end rounds on the same φ."""
    harness = harness_factory(adversary_manifest("t-adv-dx-nan", "dilocox", codec="bf16"), harness_class=FaultHarness)
    honest, bad = start_swarm(harness, 2, "nan")
    bad_id = bad.peer_id
    for node in honest:
        node.wait_log(f"banned {bad_id}", 150)
    banned_at = time.time()
    for node in honest:
        node.wait_for(lambda ev: any(e["event"] == "round" and e["time"] > banned_at + 1
                                     for e in ev), 60, "a round after the ban")
    stop_all([*honest, bad])
    refused = [s for n in honest for r in n.events("round") for s in r.get("refused") or []]
    # the bf16 codec refuses it while decoding, before the contribution checks
    assert len(refused) >= 4 and all(bad_id in s and "nan or inf" in s.lower() for s in refused)
    common = assert_phi_heals(honest, min_rounds=2)
    print(f"dilocox nan: {len(refused)} refusals; honest φ checked over rounds {common}")


def test_random_weights_of_thetas_norm_are_refused_and_their_sender_banned(harness_factory):
    """θ-only snapshots (the default layout and int4 wire): random weights of θ's norm, tensor by
    tensor, pass the norm check, and the wire's int4 rounding puts honest partners so far apart
    that their distance can lie within the refusal bound; along the node's own tensors they lie
    about ‖θ‖ away where honest partners lie a round's change of norm (the pull bound's radial
    part: protocol/pull_bound.py). Refused, the sender banned, no honest node refused, and the
    honest nodes keep swapping with each other. (−θ, refused on both statistics:
    tests/unit/test_pull_bound.py.)"""
    kind = "theta-random"
    manifest = adversary_manifest(f"t-adv-{kind}")
    manifest.protocol.snapshot, manifest.protocol.wire_dtype = "theta", "int4"
    harness = harness_factory(manifest, harness_class=FaultHarness)
    honest, bad = start_swarm(harness, 3, kind)
    bad_id = bad.peer_id
    banner, _ = wait_any_log(honest, f"banned {bad_id}", 240)
    banned_at = time.time()
    other = next(n for n in honest if n is not banner)
    banner.wait_for(swapped_with(other.peer_id, banned_at), 120,
                    "a swap with an honest peer after the ban")
    stop_all([*honest, bad])
    refused = [s for n in honest for r in n.events("round") for s in r.get("refused") or []]
    assert len(refused) >= 2, refused
    assert all(bad_id in s and ("median distance of its recent partners" in s
                                or "along this node's own tensors" in s) for s in refused), refused
    assert "adversary: offering" in bad.log_tail(100_000)
    for node in honest:
        assert finished(node.events())
