"""The hypercube pairing schedule (protocol/matching.py hypercube_partner): mutual choices, an
exact average over 2^k members in k rounds of pairwise averaging, and every member still paired
where the member count is no power of two."""

import random

import pytest

from protocol.errors import ConfigurationError
from protocol.matching import MatchingState, ReadyAnnouncement, hypercube_partner, match_round

MANIFEST = "manifest-a"


def members(n: int) -> list[str]:
    return [f"peer-{i:03d}" for i in range(n)]


def pairs_of_round(names: list[str], round_index: int, schedule: str, seed: int) -> dict:
    states = {n: MatchingState(n, MANIFEST, round_index, schedule=schedule) for n in names}
    ready = [ReadyAnnouncement(n, MANIFEST, round_index) for n in names]
    return match_round(states, ready, random.Random(seed), random.Random(seed + 1))


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 16])
def test_the_choice_is_mutual_and_never_oneself(n):
    names = members(n)
    for round_index in range(12):
        for node in names:
            partner = hypercube_partner(node, names, round_index)
            assert partner != node
            if partner is not None:
                assert hypercube_partner(partner, names, round_index) == node


def averaged_spread(names: list[str], schedule: str, rounds: range, seed: int) -> float:
    """Pairwise averaging of one number per member over `rounds`; the spread left."""
    value = {n: float(i) for i, n in enumerate(names)}
    for round_index in rounds:
        for node, pair in pairs_of_round(names, round_index, schedule, seed + round_index).items():
            if pair is not None and node < pair.partner:
                value[node] = value[pair.partner] = (value[node] + value[pair.partner]) / 2
    return max(value.values()) - min(value.values())


@pytest.mark.parametrize("n,k", [(8, 3), (16, 4)])
def test_k_rounds_of_one_epoch_average_over_all_2_to_the_k_members(n, k):
    names = members(n)
    for epoch in range(3):
        assert averaged_spread(names, "hypercube", range(epoch * k, (epoch + 1) * k), 7) == 0.0
    # random pairs over the same rounds leave a spread (the property the schedule buys)
    assert averaged_spread(names, "random", range(k), 7) > 0.0


@pytest.mark.parametrize("n", [3, 6, 7])
def test_without_a_power_of_two_every_member_still_pairs_when_it_can(n):
    names = members(n)
    for round_index in range(6):
        pairs = pairs_of_round(names, round_index, "hypercube", round_index)
        assert sum(p is not None for p in pairs.values()) == n - n % 2


def test_an_unknown_schedule_is_refused_with_the_choices():
    with pytest.raises(ConfigurationError, match="hypercube"):
        MatchingState("a", MANIFEST, 0, schedule="ring")
