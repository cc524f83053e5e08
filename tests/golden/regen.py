"""Rewrite tests/golden/outer_steps.json and payloads.msgpack from this machine's results
(tests/golden/cases.py).

    .venv/bin/python -m tests.golden.regen

Only after a deliberate change of an outer step or a codec (or a torch release known to change
their bits): the digests are what members of a swarm must compute alike, so a change of any of
them means nodes of the last release and of the next one drift apart or refuse each other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

import msgpack

from tests.golden.cases import all_cases, digests, payloads, read_payloads

GOLDEN = Path(__file__).resolve().parent / "outer_steps.json"
PAYLOADS = Path(__file__).resolve().parent / "payloads.msgpack"


def main() -> int:
    old = json.loads(GOLDEN.read_text())["digests"] if GOLDEN.exists() else {}
    PAYLOADS.write_bytes(msgpack.packb(payloads(), use_bin_type=True))
    new = {case: digests(case, run) for case, run in all_cases(read_payloads(PAYLOADS)).items()}
    changed = sorted(f"{case}/{part}" for case, parts in new.items() for part, value in parts.items()
                     if old.get(case, {}).get(part) != value)
    GOLDEN.write_text(json.dumps({"written_with": {"torch": torch.__version__, "numpy": np.__version__},
                                  "digests": new}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: {len(changed)} of {sum(map(len, new.values()))} digests changed")
    for name in changed:
        print(f"  changed: {name}")
    if changed:
        print("\n" + "!" * 78 + "\n!! THE BITS OF AN OUTER STEP OR A CODEC CHANGED. Say so in CHANGELOG.md under the\n"
              "!! next release: which steps or codecs, why, and that swarms must upgrade together\n"
              "!! (members of the last release compute other bits and drift apart).\n" + "!" * 78,
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
