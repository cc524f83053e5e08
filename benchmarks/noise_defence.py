"""The plausible-noise adversary in the simulator, with and without the noise check (issue 24).

    nice -n 10 .venv/bin/python benchmarks/noise_defence.py --protocol noloco --json benchmarks/noise_defence_noloco.json
    nice -n 10 .venv/bin/python benchmarks/noise_defence.py --protocol dilocox --json benchmarks/noise_defence_dilocox.json

N replicas of the `tiny` model run the daemon's own round classes (node/simulator); the last
replica is the adversary: it trains honestly but what it sends is noise of its true progress's
norm, tensor by tensor (NoLoCo: θ = φ + noise in its snapshot; DiLoCoX: noise compressed in place
of Δ, with any codec), as tests/adversary.py's `noise` kind does to a daemon. Four arms per N,
same seed, same data streams: `none` (all honest, check off: `contributions.noise_ratio = 0`),
`noise` (adversary, check off), `none+check` and `noise+check` (the check at --ratio).
A replica bans a sender after contributions.ban_after refusals, as the daemon does (the
simulator leaves it out of that replica's matching: node/simulator/noloco_link.py). `none+check`
with no refusal computes exactly what `none` does (the check draws no random numbers; measured:
the same final losses to the last digit), so `--arms none+check,noise,noise+check` suffices.
Reported: the honest replicas' mean final validation loss and its change from `none`, the
contributions refused by sender (an honest sender's refusal is the defence failing), and how many
of the adversary's contributions the honest replicas applied.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from node.config.schema import load_config  # noqa: E402
from node.simulator import Simulation, SimulationSettings  # noqa: E402
from node.simulator.replica import replica_name  # noqa: E402
from protocol.structure import magnitude_score  # noqa: E402


def noise_like(delta) -> dict:
    """Gaussian noise with each tensor's norm (the adversary's output)."""
    out = {}
    for name, tensor in delta.items():
        z = torch.randn_like(tensor)
        out[name] = z * (tensor.norm() / z.norm().clamp_min(1e-12))
    return out


def make_adversary(method, name: str, protocol: str) -> None:
    """Patches replica `name`'s round (this instance only) to send noise of its progress's norm."""
    policy = method.rounds[name]
    if protocol == "noloco":
        import dataclasses

        from node.rounds.noloco import payload
        policy._encoded = lambda own: payload.encode_snapshot(
            dataclasses.replace(own, local_progress=noise_like(own.local_progress)),
            policy.config.wire_dtype, policy.config.snapshot)
    else:
        honest = type(policy.outer).compress
        policy.outer.compress = lambda delta, r: honest(policy.outer, noise_like(dict(delta)), r)


def run_arm(args, workers: int, adversary: bool, ratio: float) -> dict:
    cfg = load_config(None, ['model.preset="tiny"', f"data.seq_len={args.seq_len}",
                             f"train.micro_batch_size={args.micro_batch}",
                             f"train.tokens_per_step={args.micro_batch * args.seq_len}",
                             f"train.lr={args.lr}", f"train.warmup_steps={args.warmup}",
                             f"train.eval_batches={args.eval_batches}", "train.threads=1",
                             'train.device="cpu"'])
    settings = SimulationSettings(args.protocol, workers=workers, inner_steps=args.inner_steps,
                                  rounds=args.rounds, seed=args.seed, eval_every=args.rounds,
                                  contribution_values={"noise_ratio": ratio},
                                  protocol_values={"noise_filter": True} if args.protocol == "dilocox" else {},
                                  snapshot=args.snapshot if args.protocol == "noloco" else None)
    sim = Simulation(settings, cfg)
    method, bad = sim.method, replica_name(workers - 1)
    if adversary:
        make_adversary(method, bad, args.protocol)
    refused: Counter = Counter()  # (honest or adversary sender, reason)
    for name, policy in method.rounds.items():
        link_refused = policy.link.refused

        def counted(peer, reason, sentence, link_refused=link_refused, receiver=name):
            if receiver != bad or not adversary:
                refused[("adversary" if adversary and peer == bad else "honest", reason)] += 1
            link_refused(peer, reason, sentence)
        policy.link.refused = counted
    scores: dict[str, list[float]] = {"honest": [], "adversary": []}  # NoLoCo: each s judged
    if args.protocol == "noloco" and ratio > 0:
        for name, policy in method.rounds.items():
            check = policy.noise_check.check

            def scored(sender, received, reference, what, check=check, receiver=name):
                if receiver != bad or not adversary:
                    scores["adversary" if adversary and sender == bad else "honest"].append(
                        magnitude_score(received, reference)[0])
                return check(sender, received, reference, what)
            policy.noise_check.check = scored
    used = 0
    end_round = {n: p.end_round for n, p in method.rounds.items()}
    for name, policy in method.rounds.items():
        def recorded(round_index, name=name):
            nonlocal used
            outcome = end_round[name](round_index)
            if adversary and name != bad and bad in outcome.partners:
                used += 1
            return outcome
        policy.end_round = recorded
    started = time.time()
    sim.run()
    honest = [r for r in method.replicas if not adversary or r.name != bad]
    finals = [r.trainer.evaluate() for r in honest]
    return {"workers": workers, "adversary": adversary, "noise_ratio": ratio,
            "honest_final_val_loss": finals, "mean": statistics.fmean(finals),
            "refused": {f"{who} {reason}": n for (who, reason), n in sorted(refused.items())},
            "honest_refused": sum(n for (who, _), n in refused.items() if who == "honest"),
            "adversary_used": used, "minutes": (time.time() - started) / 60,
            "scores": {who: {"n": len(v), "min": min(v), "median": statistics.median(v),
                             "max": max(v)} for who, v in scores.items() if v}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--protocol", choices=("noloco", "dilocox"), required=True)
    p.add_argument("--workers", default="4,8")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("-H", "--inner-steps", type=int, default=10)
    p.add_argument("--ratio", type=float, default=0.1, help="contributions.noise_ratio when on")
    p.add_argument("--snapshot", choices=("theta", "phi_delta"), default="phi_delta",
                   help="NoLoCo's protocol.snapshot (the check needs phi_delta)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default="none,noise,none+check,noise+check")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        for arm in args.arms.split(","):
            result = run_arm(args, workers, arm.startswith("noise"),
                             args.ratio if arm.endswith("+check") else 0.0)
            result["arm"] = arm
            results.append(result)
            print(json.dumps(result), flush=True)
            if args.json:
                args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                                 "arms": results}, indent=1))
    print("| N | arm | honest replicas' final val loss | vs none | adversary's contributions "
          "applied | refused (sender reason: count) |\n|---|---|---|---|---|---|")
    for r in results:
        # `none+check` that refused no one computed exactly what `none` does (the check uses no
        # randomness): it stands in for `none` where that arm was not run
        none = next((x for x in results if x["workers"] == r["workers"] and x["arm"] == "none"),
                    None) or next((x for x in results if x["workers"] == r["workers"]
                                   and x["arm"] == "none+check" and not x["honest_refused"]), None)
        refusals = ", ".join(f"{k}: {v}" for k, v in r["refused"].items()) or "none"
        change = f"{r['mean'] / none['mean'] - 1:+.2%}" if none else "(no reference arm run)"
        print(f"| {r['workers']} | {r['arm']} | {r['mean']:.4f} | {change} "
              f"| {r['adversary_used'] if r['adversary'] else '-'} | {refusals} |")


if __name__ == "__main__":
    main()
