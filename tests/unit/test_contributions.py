import pytest
import torch

from node.rounds.contributions import BanList, ContributionRefused, check_contribution, global_norm

OWN = {"a": torch.ones(3, 4), "b": torch.ones(5)}


def check(received, ratio=10.0):
    check_contribution("peerX", received, OWN, global_norm(OWN), ratio, "NoLoCo progress")


def test_a_sound_contribution_passes():
    check({"a": torch.full((3, 4), 2.0), "b": -torch.ones(5)})


@pytest.mark.parametrize("received, reason, fragment", [
    ({"a": torch.ones(3, 4)}, "layout", "wrong tensor names (missing ['b']"),
    ({"a": torch.ones(4, 3), "b": torch.ones(5)}, "layout", "tensor a of shape (4, 3), expected (3, 4)"),
    ({"a": torch.full((3, 4), float("nan")), "b": torch.ones(5)}, "not_finite", "NaN or Inf in tensor a"),
    ({"a": torch.ones(3, 4), "b": torch.full((5,), float("inf"))}, "not_finite", "NaN or Inf in tensor b"),
    ({"a": 1000 * torch.ones(3, 4), "b": torch.ones(5)}, "norm", "more than 10x this node's own"),
])
def test_bad_contributions_are_refused_with_a_reason(received, reason, fragment):
    with pytest.raises(ContributionRefused) as err:
        check(received)
    assert err.value.reason == reason and fragment in str(err.value)
    assert str(err.value).startswith("NoLoCo progress from peerX")


def test_repeat_offenders_are_banned_for_a_while():
    now = [0.0]
    bans = BanList(ban_after=3, ban_seconds=60, clock=lambda: now[0])
    assert not bans.strike("p", "norm") and not bans.strike("p", "norm")
    assert not bans.is_banned("p")
    assert bans.strike("p", "not_finite")
    assert bans.is_banned("p") and bans.banned() == ["p"]
    assert bans.refused_by_reason == {"norm": 2, "not_finite": 1}
    now[0] = 59.9
    assert bans.is_banned("p")
    now[0] = 60.0
    assert not bans.is_banned("p") and bans.banned() == []


def test_refuse_bans_through_the_given_callback_on_the_last_strike():
    bans, banned = BanList(ban_after=2, ban_seconds=30), []
    bans.refuse("p", "norm", "NoLoCo progress from p has norm 1e6; dropped", lambda *a: banned.append(a))
    assert banned == []
    bans.refuse("p", "norm", "again", lambda *a: banned.append(a))
    assert banned == [("p", 30)]


def test_refusals_no_round_reports_are_kept_for_the_status_view():
    """A forged member record and a lying state server are counted in `other_refusals` (the
    daemon shows them under `refused`); a round's contribution refusals are not (the round's
    outcome counts them)."""
    bans = BanList(ban_after=5, ban_seconds=30)
    bans.refuse("p", "norm", "NoLoCo progress from p has norm 1e6; dropped", lambda *a: None)
    bans.refuse("q", "FORGED_RECORD", "a forged record", lambda *a: None, counted_elsewhere=False)
    bans.ban_now("r", "state_round", "r claims round 10^6", lambda *a: None)
    assert bans.other_refusals == {"FORGED_RECORD": 1, "state_round": 1}
    assert bans.refused_by_reason == {"norm": 1, "FORGED_RECORD": 1, "state_round": 1}


def test_strikes_far_apart_do_not_add_up_to_a_ban():
    now = [0.0]
    bans = BanList(ban_after=2, ban_seconds=60, clock=lambda: now[0])
    assert not bans.strike("p", "norm")
    now[0] = 60.0  # the first strike has left the window
    assert not bans.strike("p", "norm")
    now[0] = 119.0
    assert bans.strike("p", "norm") and bans.is_banned("p")


@pytest.mark.parametrize("reason", ["REPLAYED", "BUSY", "TIMEOUT", "BAD_SIGNATURE", "MALFORMED"])
def test_transport_refusals_for_misbehaviour_ban(reason):
    bans, banned = BanList(ban_after=2, ban_seconds=30), []
    bans.transport_refusal("p", reason, lambda *a: banned.append(a))
    assert banned == []
    bans.transport_refusal("p", reason, lambda *a: banned.append(a))
    assert banned == [("p", 30)] and bans.is_banned("p")
    assert bans.refused_by_reason == {reason.lower(): 2}


@pytest.mark.parametrize("reason", ["STALE_ROUND", "EXPIRED", "TRUNCATED", "REFUSED", "NOT_PAIRED",
                                    "BANNED", "NO_ROOM", "HELD"])
def test_transport_refusals_an_honest_peer_meets_never_strike(reason):
    bans, banned = BanList(ban_after=1, ban_seconds=30), []
    for _ in range(5):
        bans.transport_refusal("p", reason, lambda *a: banned.append(a))
    assert banned == [] and not bans.is_banned("p") and not bans.refused_by_reason


def test_strike_table_stays_bounded_under_minted_peer_ids():
    bans = BanList(ban_after=3, ban_seconds=60)
    for i in range(5000):
        bans.strike(f"peer-{i}", "norm")
    assert len(bans.strikes) <= 1025


def _updates(seed: int = 0, elements: int = 200_000, shared: float = 0.5):
    """Two honest-like updates: a common direction plus each one's own noise (cosine ~ shared),
    and random noise of the same norm as the second."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(elements, generator=g)
    own = {"w": shared * common + (1 - shared) * torch.randn(elements, generator=g)}
    theirs = {"w": shared * common + (1 - shared) * torch.randn(elements, generator=g)}
    noise = torch.randn(elements, generator=g)
    noise = {"w": noise * theirs["w"].norm() / noise.norm()}
    return own, theirs, noise


def check_aligned(received, own, sigmas=5.0):
    check_contribution("peerX", received, own, global_norm(own), 10.0, "NoLoCo progress", sigmas)


def test_an_update_correlated_with_ours_passes_the_alignment_check():
    own, theirs, _ = _updates(shared=0.3)  # cosine about 0.16: far above 5/sqrt(2e5) = 0.011
    check_aligned(theirs, own)


@pytest.mark.parametrize("seed", range(5))
def test_noise_of_the_right_norm_is_refused_as_noise(seed):
    own, _, noise = _updates(seed)
    with pytest.raises(ContributionRefused) as err:
        check_aligned(noise, own)
    assert err.value.reason == "noise" and "below the noise floor" in str(err.value)


def test_a_reversed_update_is_refused_and_the_check_can_be_turned_off():
    own, theirs, noise = _updates()
    with pytest.raises(ContributionRefused, match="random or reversed"):
        check_aligned({"w": -theirs["w"]}, own)
    check_aligned(noise, own, sigmas=0.0)  # 0: off, as DiLoCoX's compressed messages use it

