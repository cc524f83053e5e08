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

With the open swarm's lever, `--per-hour R,...` (admission.new_members_per_hour): every honest
node runs the daemon's NewcomerGate (node/daemon/newcomers.py) on a clock of `--round-s`
seconds a round; the honest nodes' first view holds only each other, and the Sybils flood in
at round 1, so the gate lets them become eligible at R an hour (its matching declines a
proposal from one it holds back, as the daemon's does). 0 in the list is the run without it.

    .venv/bin/python benchmarks/sybil_share.py --per-hour 0,6,60 --json benchmarks/sybil_lever.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.daemon.newcomers import NewcomerGate  # noqa: E402
from protocol.matching import MatchingState, ReadyAnnouncement, match_round  # noqa: E402

MANIFEST = "m"


def measure(honest: int, sybils: int, rounds: int, seed: int, per_hour: float = 0.0,
            round_s: float = 60.0) -> dict:
    rng, order = random.Random(seed), random.Random(seed + 1)
    names = [f"h{i:03d}" for i in range(honest)] + [f"s{i:04d}" for i in range(sybils)]
    now = [0.0]
    gates = {n: NewcomerGate(per_hour, clock=lambda: now[0]) for n in names[:honest]} \
        if per_hour else {}
    for gate in gates.values():  # the first view: the honest members, before the flood
        gate.admit(names[:honest])
    states = {n: MatchingState(n, MANIFEST, admitted=gates[n].is_admitted if n in gates else None)
              for n in names}
    sybil_partners = honest_partners = unpaired = 0
    for round_index in range(rounds):
        now[0] = (round_index + 1) * round_s
        for gate in gates.values():  # what each node's member cache does on eligible()
            gate.admit(names)
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
    return {"honest": honest, "sybils": sybils, "rounds": rounds, "per_hour": per_hour,
            "round_s": round_s, "sybils_admitted_at_end": min(
                (sum(gate.is_admitted(n) for n in names[honest:]) for gate in gates.values()),
                default=sybils),
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
    parser.add_argument("--per-hour", default="0", help="admission.new_members_per_hour "
                        "values to measure (0: no gate)")
    parser.add_argument("--round-s", type=float, default=60.0, help="seconds a round (the gate's clock)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.time()
    rows = [measure(h, s, args.rounds, args.seed, float(r), args.round_s)
            for r in args.per_hour.split(",") for h in map(int, args.honest.split(","))
            for s in map(int, args.sybils.split(","))]
    print(f"{args.rounds} rounds of {args.round_s:g} s each, {time.time() - started:.1f} s")
    print("| new members per hour | honest | Sybils | Sybil share of honest pairs | S/(S+H-1) | "
          "honest-honest pairs per honest round | unpaired | Sybils eligible at the end |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['per_hour'] or 'no limit'} | {r['honest']} | {r['sybils']} | "
              f"{r['sybil_share_of_pairs']:.1%} | {r['uniform_expectation']:.1%} | "
              f"{r['honest_paired_with_honest']:.1%} | {r['unpaired']:.1%} | "
              f"{r['sybils_admitted_at_end']} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
