"""The rules that end a transfer (p2p/progress.py), on an injected clock: a transfer that keeps
moving at the swarm's minimum link rate is never cut, one that stalls is cut after its stall
bound, one that trickles below the rate is cut once it could no longer finish by its need-by,
and each says why in one sentence."""

import pytest

from p2p.errors import Reason
from p2p.limits import TransferLimits
from p2p.progress import NeedBy, Progress

MB = 10**6
# 1 Mbit/s: 125 kB a second; a stall is 30 s without a byte
LIMITS = TransferLimits(stall_s=30.0, min_rate_bytes_per_s=125_000.0)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress(clock: Clock, **kwargs) -> Progress:
    return Progress(LIMITS, clock=clock, **kwargs)


def test_a_swap_that_moves_at_the_minimum_rate_is_never_cut_however_long_it_takes():
    """48 MB each way at exactly 1 Mbit/s take 384 s, six times the old 60 s swap cut."""
    clock = Clock()
    swap = progress(clock, sending=48 * MB, receiving=48 * MB)
    for _ in range(384):
        clock.now += 1.0
        swap.moved(sent=125_000, received=125_000)
        assert swap.verdict(clock.now) is None
    assert swap.remaining == 0


def test_a_multi_stream_message_progresses_while_any_stream_moves_and_a_swap_while_either_half_does():
    clock = Clock()
    swap = progress(clock, sending=10 * MB, receiving=10 * MB, need_by=NeedBy(10_000.0))
    for second in range(100):  # only our half moves for 100 s: the swap is not stalled
        clock.now += 1.0
        swap.moved(sent=50_000)
        assert swap.verdict(clock.now) is None
    clock.now += 29.0
    assert swap.verdict(clock.now) is None


def test_no_byte_moved_for_the_stall_bound_ends_it_in_one_sentence():
    clock = Clock()
    push = progress(clock, sending=10 * MB)
    clock.now += 5.0
    push.moved(sent=MB)
    assert push.next_check(clock.now) == pytest.approx(1035.0)
    clock.now += 29.9
    assert push.verdict(clock.now) is None
    clock.now += 0.1
    refusal = push.verdict(clock.now)
    assert refusal.reason is Reason.TIMEOUT and refusal.detail == "no byte moved for 30 s"
    assert not push.too_slow and not refusal.congested


def test_a_trickler_is_cut_once_even_the_minimum_rate_could_not_finish_by_its_need_by():
    """A byte every 5 s never stalls; it is cut when the rest could not arrive in time even at
    1 Mbit/s, long before its need-by, and the sentence says at what rate it came."""
    clock = Clock()
    swap = progress(clock, sending=48 * MB, receiving=48 * MB,
                    need_by=NeedBy(600.0, "the 3 rounds it may take"))
    swap.moved(sent=48 * MB)  # our half went at once; theirs trickles
    cut_at = None
    while cut_at is None:
        clock.now += 5.0
        swap.moved(received=1)
        if swap.verdict(clock.now) is not None:
            cut_at = clock.now - 1000.0
    assert cut_at == pytest.approx(600.0 - 48 * MB / 125_000, abs=5.0)  # 216 s in, not 600
    assert swap.too_slow
    refusal = swap.verdict(clock.now)
    assert refusal.detail == ("at 2 bit/s it could not finish 48 MB within the 3 rounds it may take "
                              "(44 bytes moved)")
    assert not refusal.congested  # their half was behind: the peer's doing
    # a timer is armed for the moment the rule can first hold: one stall bound in (its rate is
    # not measured before), not at the 16 s where the minimum rate alone would already fail it
    late = progress(clock, receiving=48 * MB, need_by=NeedBy(400.0))
    assert late.next_check(clock.now) == pytest.approx(clock.now + 30.0)


def test_a_link_faster_than_the_minimum_is_judged_at_its_own_rate():
    """48 MB each way within 4 rounds of 10 s: at the swarm's 1 Mbit/s minimum that is 384 s, but
    on an 16 Mbit/s link the swap takes 24 s and is never cut; on an 8 Mbit/s link it would take
    48 s, which its own rate shows once measured (after one stall bound), not at its start."""
    clock = Clock()
    fast = progress(clock, sending=48 * MB, receiving=48 * MB, need_by=NeedBy(40.0, "4 rounds"))
    assert fast.verdict(clock.now) is None  # nothing measured yet: not judged at the minimum rate
    for _ in range(24):
        clock.now += 1.0
        fast.moved(sent=2 * MB, received=2 * MB)
        assert fast.verdict(clock.now) is None
    assert fast.remaining == 0
    slow = progress(clock, sending=48 * MB, receiving=48 * MB, need_by=NeedBy(40.0, "4 rounds"))
    verdicts = []
    for _ in range(40):
        clock.now += 1.0
        slow.moved(sent=MB, received=MB)
        verdicts.append(slow.verdict(clock.now))
    first = next(i for i, v in enumerate(verdicts) if v is not None) + 1
    assert first == 30 and slow.too_slow  # 18 MB left at 8 Mbit/s: 18 s, with 10 s to go
    assert verdicts[-1].detail == "at 8 Mbit/s it could not finish 48 MB within 4 rounds (30 MB moved)"


def test_the_default_need_by_follows_the_bytes_and_grows_when_a_reply_declares_its_size():
    clock = Clock()
    request = progress(clock)  # a request's reply size is unknown until its first frame
    assert request.need_by_at == pytest.approx(1030.0)
    request.expect(receiving=100 * MB)
    assert request.need_by_at == pytest.approx(1030.0 + 800.0)  # 100 MB at 1 Mbit/s
    clock.now += 20.0
    request.moved(received=10 * MB)
    assert request.verdict(clock.now) is None


def test_our_own_half_behind_is_our_link_and_strikes_no_one():
    clock = Clock()
    swap = progress(clock, sending=48 * MB, receiving=48 * MB, need_by=NeedBy(100.0, "one round"))
    swap.moved(received=48 * MB)
    clock.now += 30.0
    swap.moved(sent=1)
    refusal = swap.verdict(clock.now)
    assert swap.too_slow and refusal.congested
    assert "it could not finish 48 MB within one round" in refusal.detail


def test_once_all_bytes_left_the_answer_is_awaited_until_the_need_by_not_one_stall():
    """A push whose last bytes sit in the link's buffers: the sender sees no byte move while the
    receiver still reads them; it waits for the answer until the push's need-by (what its bytes
    take at the minimum rate), or a stall after its last byte if that is later."""
    clock = Clock()
    push = progress(clock, sending=10 * MB)  # need-by: 30 + 80 s
    clock.now += 1.0
    push.moved(sent=10 * MB)  # all written at once into buffers
    clock.now += 100.0        # nothing moves while the receiver reads what is buffered
    assert push.verdict(clock.now) is None
    assert push.next_check(clock.now) == pytest.approx(1110.0)
    clock.now += 10.0
    assert push.verdict(clock.now).detail == "its 10 MB moved, but it was not answered within 110 s"
    control = progress(clock, need_by=NeedBy(10.0, "the 10 s a matching message may take"))
    clock.now += 5.0
    control.moved(sent=300)  # a message of no payload: its header went, its answer is due at 10 s
    assert control.verdict(clock.now) is None
    clock.now += 5.0
    assert control.verdict(clock.now).detail == ("its 0 bytes moved, but it was not answered within "
                                                 "the 10 s a matching message may take")


def test_a_writer_drains_several_times_per_stall_at_the_minimum_rate():
    assert progress(Clock()).drain_bytes() == 937_500  # 125 kB/s x 30 s / 4
    slow = Progress(TransferLimits(stall_s=30.0, min_rate_bytes_per_s=31_250.0))
    assert slow.drain_bytes() * 4 / 31_250.0 == pytest.approx(30.0)


def test_a_progress_of_unknown_size_ends_by_the_stall_bound_alone():
    clock = Clock()
    stream = progress(clock, rate_bound=False)
    clock.now += 29.0
    stream.moved(received=1)
    clock.now += 29.0
    assert stream.verdict(clock.now) is None
    clock.now += 1.0
    assert stream.verdict(clock.now).detail == "no byte moved for 30 s"
