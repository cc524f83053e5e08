"""No global barrier (issue 5): one node at a third of the others' speed must not slow them.

Two arms in one run, same manifest (NoLoCo, overlap timing), same seeds, real daemons on
loopback: A) N normal nodes; B) the same N normal nodes plus one slow node. Every step is padded
to a fixed wall time with `train.min_step_seconds` (node-local), the slow node's three times as
long: on a shared 2-core machine this keeps the CPU unsaturated, so the arms differ in the slow
peer and not in how many processes share the cores. Reported: each normal node's rounds per
minute in both arms (after a warm-up of rounds), their ratio B / A (target: within 10%), the
pairs the slow node formed, its jumps to the swarm's round, and its validation loss at its
first and last evaluation.

    .venv/bin/python benchmarks/no_barrier.py --normal 3 --step-seconds 0.3 --rounds 24 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.swarm_harness import SwarmHarness, left, small_manifest  # noqa: E402

WARMUP_ROUNDS = 2


def rounds_per_minute(rounds: list[dict]) -> float:
    """Rounds completed per minute of wall clock, after the warm-up rounds."""
    timed = rounds[WARMUP_ROUNDS:]
    return 60.0 * (len(timed) - 1) / (timed[-1]["time"] - timed[0]["time"])


def run_arm(base: Path, args: argparse.Namespace, with_slow: bool) -> dict:
    manifest = small_manifest("no-barrier", "noloco", inner_steps=args.inner_steps)
    manifest.train.eval_every = args.inner_steps * 4  # every 4th round (node-local)
    harness = SwarmHarness(base, manifest)
    normal_steps = args.rounds * args.inner_steps

    def extra(step_seconds: float, steps: int) -> list[str]:
        return ["--set", f"train.min_step_seconds={step_seconds}", "--max-steps", str(steps)]

    try:
        count = args.normal + (1 if with_slow else 0)
        first = harness.start_node(0, extra=[*extra(args.step_seconds, normal_steps),
                                             "--min-peers", str(count - 1)])
        first.wait_for(lambda ev: any(e["event"] == "joined" for e in ev), 120, "joining")
        normal = [first] + [harness.start_node(i, [first.address], extra(args.step_seconds, normal_steps))
                            for i in range(1, args.normal)]
        # The slow node has the swarm's step budget: it trains a third of the steps, and at the
        # ends of rounds jumps to the swarm's round (protocol/matching.py catch_up_round), so it
        # runs about as long as the others. It evaluates every round (its rounds are few).
        slow = harness.start_node(args.normal, [first.address],
                                  [*extra(3 * args.step_seconds, normal_steps),
                                   "--set", f"train.eval_every={args.inner_steps}"]) if with_slow else None
        deadline = 60 + 3 * normal_steps * args.step_seconds
        for node in normal + ([slow] if slow else []):
            node.wait_for(left, deadline, "the end of training")
        result = {"rpm": [rounds_per_minute(n.events("round")) for n in normal]}
        if slow is not None:
            rounds = slow.events("round")
            slow_id = slow.peer_id
            vals = [r["val_loss"] for r in rounds if "val_loss" in r]
            result.update(
                slow_rpm=rounds_per_minute(rounds), slow_rounds=len(rounds),
                slow_paired=sum(1 for r in rounds if r.get("partner")),
                slow_caught_up=sum(1 for r in rounds if r.get("caught_up_to") is not None),
                slow_steps=len(rounds) * args.inner_steps,  # H steps trained per round, jumps aside
                paired_with_slow=sum(1 for n in normal for r in n.events("round")
                                     if r.get("partner") == slow_id),
                slow_val_first=vals[0], slow_val_last=vals[-1])
        return result
    finally:
        harness.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--normal", type=int, default=3, help="normal nodes (default 3)")
    parser.add_argument("--step-seconds", type=float, default=0.3,
                        help="padded wall time of a normal node's step (the slow node: 3x)")
    parser.add_argument("--inner-steps", type=int, default=10, help="H (default 10)")
    parser.add_argument("--rounds", type=int, default=24, help="rounds of a normal node")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of arms, run A B, B A, "
                        "A B, ... so that a drift in the machine's load hits both arms alike")
    args = parser.parse_args()
    started = time.time()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for with_slow in ((False, True) if repeat % 2 == 0 else (True, False)):
                arm = Path(tmp) / f"{repeat}-{'b' if with_slow else 'a'}"
                runs[with_slow].append(run_arm(arm, args, with_slow))
    alone = {"rpm": [statistics.median(r["rpm"][i] for r in runs[False]) for i in range(args.normal)]}
    mixed = {**runs[True][-1],
             "rpm": [statistics.median(r["rpm"][i] for r in runs[True]) for i in range(args.normal)]}
    ratios = [b / a for a, b in zip(alone["rpm"], mixed["rpm"])]
    print(f"{args.normal} normal NoLoCo nodes (overlap), steps padded to {args.step_seconds} s, "
          f"H = {args.inner_steps}, {args.rounds} rounds each; the slow node: steps of "
          f"{3 * args.step_seconds:g} s; {args.repeats} repeats of each arm (medians); "
          f"whole run {(time.time() - started) / 60:.1f} min, load average now "
          f"{os.getloadavg()[0]:.1f}")
    print("per repeat, rounds/min of the normal nodes without / with the slow node: " + "; ".join(
        f"{[round(x, 2) for x in a['rpm']]} / {[round(x, 2) for x in b['rpm']]}"
        for a, b in zip(runs[False], runs[True])))
    print("| normal node | rounds/min without the slow node | with it | ratio |")
    print("|---|---|---|---|")
    for i, (a, b, r) in enumerate(zip(alone["rpm"], mixed["rpm"], ratios)):
        print(f"| {i} | {a:.2f} | {b:.2f} | {r:.3f} |")
    worst = min(ratios)
    print(f"median ratio {statistics.median(ratios):.3f}, worst {worst:.3f}: target within 10% "
          f"{'met' if abs(1 - worst) <= 0.10 and abs(1 - max(ratios)) <= 0.10 else 'not met'}")
    print(f"slow node (last repeat): {mixed['slow_rpm']:.2f} rounds/min ({mixed['slow_rounds']} rounds), "
          f"paired in {mixed['slow_paired']} of them, jumped to the swarm's round "
          f"{mixed['slow_caught_up']} times (trained {mixed['slow_steps']} steps); the normal nodes paired with it "
          f"{mixed['paired_with_slow']} times; validation loss {mixed['slow_val_first']:.4f} -> "
          f"{mixed['slow_val_last']:.4f}")


if __name__ == "__main__":
    main()
