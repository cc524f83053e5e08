"""Sybil pressure on NoLoCo's pairing (issue 24): what share of an honest node's partners one
operator's many fresh identities take, on the real matching code (protocol/matching.py).

    .venv/bin/python benchmarks/sybil_share.py --json benchmarks/sybil_share.json

H honest nodes and S Sybil identities, all on the swarm's manifest, all ready in the same round
(the Sybils are eager: they announce every round and follow the matching protocol, which is
what an operator who wants partners does). Each round runs `match_round` to quiescence with the
deliveries shuffled; reported per (H, S): the share of the honest nodes' pairs whose partner is
a Sybil, and the share of honest node-rounds paired with another honest node, over `--rounds`
rounds. What the pairing alone gives: no admission lever is applied (an allowlist swarm refuses
and hides unlisted keys, node/daemon/members.py, so there the share is 0 by construction).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol.matching import MatchingState, ReadyAnnouncement, match_round  # noqa: E402

MANIFEST = "m"


def measure(honest: int, sybils: int, rounds: int, seed: int) -> dict:
    rng, order = random.Random(seed), random.Random(seed + 1)
    names = [f"h{i:03d}" for i in range(honest)] + [f"s{i:04d}" for i in range(sybils)]
    states = {n: MatchingState(n, MANIFEST) for n in names}
    sybil_partners = honest_partners = unpaired = 0
    for round_index in range(rounds):
        ready = [ReadyAnnouncement(n, MANIFEST, round_index) for n in names]
        pairs = match_round(states, ready, rng, order)
        for name in names[:honest]:
            pair = pairs[name]
            if pair is None:
                unpaired += 1
            elif pair.partner.startswith("s"):
                sybil_partners += 1
            else:
                honest_partners += 1
        for state in states.values():
            state.end_round()
    node_rounds = honest * rounds
    paired = sybil_partners + honest_partners
    return {"honest": honest, "sybils": sybils, "rounds": rounds,
            "sybil_share_of_pairs": sybil_partners / paired if paired else 0.0,
            "honest_paired_with_honest": honest_partners / node_rounds,
            "unpaired": unpaired / node_rounds,
            "uniform_expectation": sybils / (sybils + honest - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--honest", default="4,8")
    parser.add_argument("--sybils", default="0,1,4,16,64")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.time()
    rows = [measure(h, s, args.rounds, args.seed) for h in map(int, args.honest.split(","))
            for s in map(int, args.sybils.split(","))]
    print(f"{args.rounds} rounds each, {time.time() - started:.1f} s")
    print("| honest | Sybils | Sybil share of honest pairs | S/(S+H-1) | honest-honest pairs per honest round | unpaired |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['honest']} | {r['sybils']} | {r['sybil_share_of_pairs']:.1%} | "
              f"{r['uniform_expectation']:.1%} | {r['honest_paired_with_honest']:.1%} | {r['unpaired']:.1%} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
