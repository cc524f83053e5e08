"""doctor's clock finding: its thresholds follow the member record's lifetime (p2p/membership.py)."""

from node.ops.doctor import clock_finding
from p2p.membership import CLOCK_SKEW_TOLERANCE_S


def test_the_clock_warns_from_a_third_of_the_records_lifetime_and_fails_past_the_tolerance():
    ttl_s = 15.0
    third = (ttl_s + CLOCK_SKEW_TOLERANCE_S) / 3
    assert clock_finding([(third - 1, "peerA")], ttl_s).level == "ok"
    # the largest offset decides, either sign
    warned = clock_finding([(0.1, "peerA"), (-(third + 1), "peerB")], ttl_s)
    assert warned.level == "warn" and "peerB" in warned.text and "set the clock (NTP)" in warned.text
    assert clock_finding([(CLOCK_SKEW_TOLERANCE_S + 1, "peerA")], ttl_s).level == "fail"
    # a clock 60 s off is tolerated by membership, and said
    assert clock_finding([(60.0, "peerA")], ttl_s).level == "warn"
    assert clock_finding([], ttl_s).level == "warn"
