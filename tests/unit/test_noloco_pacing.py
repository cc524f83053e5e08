"""SwapPacer (node/rounds/noloco/pacing.py): how often a NoLoCo node pairs, from its swaps'
and rounds' measured seconds."""

import pytest

from node.rounds.noloco.pacing import SwapPacer


def paced(swaps: list[float], rounds: list[float], max_interval: int = 4) -> SwapPacer:
    pacer = SwapPacer(max_interval)
    for seconds in swaps:
        pacer.record_swap(seconds)
    for seconds in rounds:
        pacer.record_round(seconds)
    pacer.update()
    return pacer


def pairing_rounds(pacer: SwapPacer, rounds: range) -> list[int]:
    paired = []
    for r in rounds:
        if pacer.pairs_in(r, swap_in_flight=False):
            pacer.paired(r)
            paired.append(r)
    return paired


def test_swaps_that_fit_a_round_pair_every_round():
    pacer = paced([0.5, 0.9, 0.7], [1.0, 1.0, 1.1])
    assert pacer.interval == 1
    assert pairing_rounds(pacer, range(6)) == [0, 1, 2, 3, 4, 5]


def test_swaps_of_two_and_a_half_rounds_pair_every_third_round():
    pacer = paced([2.5, 2.4, 2.6], [1.0, 1.0, 1.0])
    assert pacer.interval == 3
    assert pairing_rounds(pacer, range(9)) == [0, 3, 6]


def test_the_interval_is_capped_at_max_swap_rounds():
    assert paced([30.0], [1.0], max_interval=4).interval == 4


def test_one_slow_partner_among_fast_ones_does_not_make_a_node_rest():
    assert paced([0.3, 0.4, 9.0, 0.3, 0.5], [1.0] * 5).interval == 1


def test_a_slow_node_rests_while_its_swap_is_in_flight_and_pairs_every_round_once_swaps_fit():
    pacer = paced([3.0, 3.0, 3.0], [1.0, 1.0, 1.0])
    pacer.paired(0)
    assert pacer.interval == 3 and not pacer.pairs_in(3, swap_in_flight=True)
    assert pacer.pairs_in(3, swap_in_flight=False)
    for seconds in (0.4, 0.5, 0.4):  # the link got faster
        pacer.record_swap(seconds)
    assert pacer.update() == 1 and pacer.pairs_in(1, swap_in_flight=True)


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_swap_rounds"):
        SwapPacer(0)
