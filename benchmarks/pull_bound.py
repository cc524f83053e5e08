"""The bound on a partner's θ (protocol/pull_bound.py) in the simulator: honest cost and harm.

    flock /tmp/lowcomm-heavy.lock .venv/bin/python benchmarks/pull_bound.py --json benchmarks/pull_bound.json

N replicas of the `tiny` model run the daemon's own NoLoCo round (θ snapshots, the manifest's
wire dtype, overlap timing) on the convergence table's data and inner settings
(benchmarks/convergence.py), --steps inner steps per replica. Two parts:
- honest cost, every cell of N × H: `off` (contributions.pull_clip_ratio = 0, the code before the
  bound) against the named bound arms, all honest; reported: final validation loss and its
  change from `off`, the partner θs clipped and refused, and the largest d/m seen (d: a
  partner's distance, m: the rule's reference);
- harm, at --harm-cells: the last replica is an adversary sending the θ of tests/adversary.py's
  corrupt_theta (theta-random, theta-negate, theta-target, theta-sideways), with the bound off
  and on; reported: the honest replicas' mean final loss against the all-honest run with the
  same bound and seed, and the adversary's snapshots applied, clipped and refused (the
  simulator bans a sender after contributions.ban_after refusals, as the daemon does).
Arms "refuse" (refusal at the clipping ratio: no clipping) and "clip" (no refusal) are the two
pure forms of the rule; "bound" is the manifest's default (clip, and refuse far beyond, on the
distance and on the radial part); "distance" is the bound on the distance alone (the rule
before the radial part).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from convergence import node_config, parse_args as convergence_args  # noqa: E402
from node.config.manifest import ContributionSection  # noqa: E402
from node.simulator import Simulation, SimulationSettings  # noqa: E402
from node.simulator.replica import replica_name  # noqa: E402
from node.rounds.wire_tensors import rounding_error_norm  # noqa: E402
from protocol import pull_bound  # noqa: E402
from tests.adversary import THETA_KINDS, corrupt_theta  # noqa: E402

DEFAULT = ContributionSection()
BOUNDS = {"off": {"pull_clip_ratio": 0.0},
          "bound": {"pull_clip_ratio": DEFAULT.pull_clip_ratio,
                    "pull_refuse_ratio": DEFAULT.pull_refuse_ratio},
          "refuse": {"pull_clip_ratio": DEFAULT.pull_clip_ratio,
                     "pull_refuse_ratio": DEFAULT.pull_clip_ratio},
          "clip": {"pull_clip_ratio": DEFAULT.pull_clip_ratio, "pull_refuse_ratio": 1e6},
          "distance": {"pull_clip_ratio": DEFAULT.pull_clip_ratio,
                       "pull_refuse_ratio": DEFAULT.pull_refuse_ratio}}
RADIAL_OFF = {"distance"}  # arms judging the distance alone (the rule before the radial part)


def make_adversary(policy, kind: str) -> None:
    """Patches this replica's round (this instance only) to send `kind`'s θ."""
    import dataclasses

    from node.rounds.noloco import payload
    target: dict = {}

    def encoded(own):
        theta = own.fast_weights()
        floor = pull_bound.distance(theta, own.slow_weights) \
            + rounding_error_norm(theta, policy.config.wire_dtype)
        bad = corrupt_theta(kind, theta, floor, target)
        delta = {n: bad[n] - own.slow_weights[n].float() for n in bad}
        return payload.encode_snapshot(dataclasses.replace(own, local_progress=delta),
                                       policy.config.wire_dtype, policy.config.snapshot)
    policy._encoded = encoded


def run_arm(job: dict) -> dict:
    torch.set_num_threads(1)
    args = convergence_args([])
    workers, h, bound, kind = job["workers"], job["h"], job["bound"], job["kind"]
    settings = SimulationSettings("noloco", workers=workers, inner_steps=h,
                                  rounds=job["steps"] // h, seed=job["seed"],
                                  eval_every=job["steps"] // h, timing="overlap", snapshot="theta",
                                  contribution_values=BOUNDS[bound])
    sim = Simulation(settings, node_config(args))
    method, bad = sim.method, replica_name(workers - 1)
    if kind:
        make_adversary(method.rounds[bad], kind)
    # d/m and ρ/m_ρ of every partner θ an honest replica judged
    seen = {"honest": [], "adversary": []}
    seen_radial = {"honest": [], "adversary": []}
    # what honest replicas did with the snapshots of the adversary, and of honest partners
    counts = {who: {"applied": 0, "clipped": 0, "refused": 0} for who in ("honest", "adversary")}
    for name, policy in method.rounds.items():
        if kind and name == bad:
            continue
        if bound in RADIAL_OFF:
            policy.radial_bound = pull_bound.PullBound(0.0, 0.0)
        judge, bound_pull, checked = policy.pull_bound.judge, policy._bound_pull, policy._checked
        judge_radial = policy.radial_bound.judge
        sender = {}

        def judged(partner, distance, floor, judge=judge, sender=sender, into=seen):
            verdict = judge(partner, distance, floor)
            if verdict.reference > 0:
                into[sender["who"]].append(distance / verdict.reference)
            return verdict

        def judged_radial(partner, distance, floor, judge=judge_radial, sender=sender):
            return judged(partner, distance, floor, judge, sender, seen_radial)

        def bounded(peer, theirs, mine, floor, bound_pull=bound_pull, policy=policy,
                    sender=sender):
            clipped = policy.pulls_clipped
            out = bound_pull(peer, theirs, mine, floor)
            counts[sender["who"]]["clipped"] += policy.pulls_clipped - clipped
            return out

        def checked_(partner, reference, checked=checked, sender=sender):
            if partner is not None:
                sender["who"] = "adversary" if kind and partner.peer == bad else "honest"
            pair = checked(partner, reference)
            if partner is not None:
                counts[sender["who"]]["applied" if pair.used else "refused"] += 1
            return pair
        policy.pull_bound.judge, policy._bound_pull, policy._checked = judged, bounded, checked_
        policy.radial_bound.judge = judged_radial
    started = time.time()
    sim.run()
    honest = [r for r in method.replicas if not kind or r.name != bad]
    finals = [r.trainer.evaluate() for r in honest]

    def summary(values):
        return {who: {"n": len(v), "median": statistics.median(v), "max": max(v)}
                for who, v in values.items() if v}
    ratios, radial_ratios = summary(seen), summary(seen_radial)
    return {**job, "finals": finals, "mean": statistics.fmean(finals),
            "honest_partners": counts["honest"], "adversary": counts["adversary"] if kind else None,
            "d_over_m": ratios, "rho_over_m": radial_ratios,
            "minutes": (time.time() - started) / 60}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", default="4:25,4:50,8:25,8:50", help="N:H,...")
    p.add_argument("--bounds", default="bound", help="bound arms against `off`, honest cells")
    p.add_argument("--harm-cells", default="4:25", help="N:H,... of the adversary arms")
    p.add_argument("--harm-bounds", default="off,bound")
    p.add_argument("--kinds", default=",".join(THETA_KINDS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cell = [tuple(map(int, c.split(":"))) for c in args.cells.split(",") if c]
    harm = [tuple(map(int, c.split(":"))) for c in args.harm_cells.split(",") if c]
    common = {"steps": args.steps, "seed": args.seed}
    jobs = [{"workers": n, "h": h, "bound": b, "kind": None, **common}
            for n, h in cell for b in ["off", *args.bounds.split(",")]]
    jobs += [{"workers": n, "h": h, "bound": b, "kind": None, **common}
             for n, h in harm for b in args.harm_bounds.split(",")
             if not any(j["workers"] == n and j["h"] == h and j["bound"] == b for j in jobs)]
    jobs += [{"workers": n, "h": h, "bound": b, "kind": k, **common}
             for n, h in harm for k in args.kinds.split(",") for b in args.harm_bounds.split(",")]
    with ProcessPoolExecutor(args.processes) as pool:
        results = list(pool.map(run_arm, jobs))
    for r in results:
        print(json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "arms": results}, indent=1) + "\n")
    print(table(results))


def table(results: list[dict]) -> str:
    def reference(r):
        return next((x for x in results if x["workers"] == r["workers"] and x["h"] == r["h"]
                     and x["kind"] is None
                     and x["bound"] == ("off" if r["kind"] is None else r["bound"])), None)
    lines = ["| N | H | arm | adversary | honest final val loss | vs reference | honest θs clipped / "
             "refused | adversary's θs applied / clipped / refused | max d/m honest (adversary) | "
             "max ρ/m_ρ honest (adversary) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ref = reference(r)  # none for an honest bound arm run without `off`
        change = "-" if ref is None else f"{r['mean'] / ref['mean'] - 1:+.2%}"
        adv = r["adversary"]

        def spread(ratio):
            return (f"{ratio['honest']['max']:.2f}" if "honest" in ratio else "-") + \
                (f" ({ratio['adversary']['max']:.3g})" if "adversary" in ratio else "")
        lines.append(f"| {r['workers']} | {r['h']} | {r['bound']} | {r['kind'] or '-'} | "
                     f"{r['mean']:.4f} | {change} | "
                     f"{r['honest_partners']['clipped']} / {r['honest_partners']['refused']} | "
                     f"{'-' if adv is None else '{applied} / {clipped} / {refused}'.format(**adv)} | "
                     f"{spread(r['d_over_m'])} | {spread(r.get('rho_over_m', {}))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
