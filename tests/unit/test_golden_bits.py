"""Golden bits: the outer steps (DiLoCo, DiLoCoX with each codec, NoLoCo) and every codec's
encode and decode on fixed inputs give the bits pinned in tests/golden/outer_steps.json
(tests/golden/cases.py says what each case runs). A failure means members of the last release
and of this one compute differently: if it is deliberate (or a torch release changed a
kernel's rounding), regenerate with `python -m tests.golden.regen` and say in CHANGELOG.md that
swarms must upgrade together."""

import json
from pathlib import Path

import pytest

from tests.golden.cases import all_cases, digests, read_payloads

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
EXPECTED = json.loads((GOLDEN / "outer_steps.json").read_text())["digests"]
CASES = all_cases(read_payloads(GOLDEN / "payloads.msgpack"))


def test_every_case_is_pinned():
    assert sorted(CASES) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_bits(case):
    got = digests(case, CASES[case])
    changed = sorted(part for part in set(got) | set(EXPECTED[case]) if got.get(part) != EXPECTED[case].get(part))
    assert not changed, (f"{case}: the bits of {changed} differ from tests/golden/outer_steps.json; "
                         "a deliberate change: python -m tests.golden.regen, and a CHANGELOG.md entry")
