"""What one adversary among 4 nodes costs the honest ones (issue 8): final validation loss.

    .venv/bin/python benchmarks/adversary_loss.py --kinds nan,scale,noise,replay,stall,flood

Arms, one after another, same manifest (NoLoCo, overlap timing, the small test model), same
train seed, the same node keys, real daemons on loopback started together: `none` (4 honest nodes, run twice to show
the spread between two honest runs) and one arm per adversary kind (3 honest nodes and one
adversary run through tests/adversary.py, the test-only wrapper that patches one misbehaviour
into a real daemon). Reported per arm: the honest nodes' mean final validation loss, its
difference from the first `none` run (target: within 2%), the rounds in which an honest node
used the adversary's snapshot, its refusals by reason, and whether it banned the adversary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from p2p.identity import NodeIdentity, identity_path  # noqa: E402
from tests.faults import FaultHarness, adversary_manifest, joined  # noqa: E402
from tests.swarm_harness import left, small_manifest  # noqa: E402

NODES = 4


def run_arm(base: Path, kind: str | None, rounds: int, inner_steps: int,
            identities: list[NodeIdentity], defaults: bool = False, protocol: str = "noloco") -> dict:
    """Node i has the same key in every arm, so the same batch stream (its seed comes from the
    key): the arms differ in node 3 being an adversary, and in the pairing's randomness.
    `defaults`: the shipped contribution checks (alignment off, θ-only snapshots), not the
    adversary tests' (alignment on, φ and Δ)."""
    for i, identity in enumerate(identities):
        identity.save(identity_path(base / f"node-{i}"))
    make = (lambda swarm: small_manifest(swarm, protocol, inner_steps)) if defaults else \
        (lambda swarm: adversary_manifest(swarm, protocol, alignment_check=True,
                                         inner_steps=inner_steps))
    manifest = make(f"adv-loss-{kind or 'none'}")
    manifest.train.eval_every = inner_steps * rounds  # once, at the end (node-local schedule)
    harness = FaultHarness(base, manifest)
    steps = rounds * inner_steps
    extra = ["--max-steps", str(steps), "--min-peers", str(NODES - 1)]
    try:
        first = harness.start_node(0, extra=extra)
        first.wait_for(joined, 120, "joining")
        honest = [first] + [harness.start_node(i, [first.address], extra) for i in range(1, NODES - 1)]
        last = harness.start_node(NODES - 1, [first.address], extra, adversary=kind)
        nodes = [*honest, last] if kind is None else honest
        for node in [*honest, last]:
            node.wait_for(joined, 120, "joining")
        for node in nodes:  # the adversary may never finish (a stalled one): wait for the honest
            node.wait_for(left, 120 + 20 * steps, "the end of training")
        bad_id = last.peer_id
        finals, used, refused, banned = [], 0, Counter(), 0
        for node in nodes:
            rounds_ = node.events("round")
            finals.append([r["val_loss"] for r in rounds_ if "val_loss" in r][-1])
            if kind is None:
                continue
            used += sum(1 for r in rounds_ if r.get("partner") == bad_id or bad_id in (r.get("group") or []))
            counters = node.events("transport")[-1]
            refused.update(counters.get("refused_incoming", {}))
            refused["contribution"] += sum(1 for r in rounds_ if r.get("refused"))
            banned += f"banned {bad_id}" in node.log_tail(1_000_000) \
                or any(e["author"] == bad_id for e in node.events("equivocated"))  # banned on proof
        return {"finals": finals, "mean": statistics.fmean(finals), "used": used,
                "refused": dict(refused), "banned_by": banned, "honest": len(nodes)}
    finally:
        harness.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="nan,scale,noise,replay,stall,flood")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--defaults", action="store_true",
                        help="the shipped contribution checks (alignment off, θ-only snapshots)")
    parser.add_argument("--json", type=Path, help="also write the arms here")
    parser.add_argument("--protocol", default="noloco", choices=("noloco", "dilocox"))
    args = parser.parse_args()
    started = time.time()
    arms: dict[str, dict] = {}
    identities = [NodeIdentity.generate() for _ in range(NODES)]
    with tempfile.TemporaryDirectory(prefix="lowcomm-adv-") as tmp:
        for name in ["none", *args.kinds.split(","), "none-again"]:
            kind = None if name.startswith("none") else name
            arms[name] = run_arm(Path(tmp) / name, kind, args.rounds, args.inner_steps,
                                 identities, args.defaults, args.protocol)
            print(f"{name}: {arms[name]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "arms": arms}, indent=1))
    reference = arms["none"]["mean"]
    print(f"{NODES} nodes, {args.protocol}, H = {args.inner_steps}, {args.rounds} rounds; whole run "
          f"{(time.time() - started) / 60:.1f} min, load average now {os.getloadavg()[0]:.1f}")
    print("| arm | honest nodes' final val loss (mean) | vs no adversary | rounds using its snapshot | refusals | banned by |")
    print("|---|---|---|---|---|---|")
    for name, arm in arms.items():
        change = arm["mean"] / reference - 1
        verdict = "" if name == "none" else (" (met)" if abs(change) <= 0.02 else " (not met)")
        refusals = ", ".join(f"{k} {v}" for k, v in sorted(arm["refused"].items())) or "-"
        banned = f"{arm['banned_by']} of {arm['honest']}" if not name.startswith("none") else "-"
        print(f"| {name} | {arm['mean']:.4f} | {change:+.2%}{verdict} | "
              f"{arm['used'] if not name.startswith('none') else '-'} | {refusals} | {banned} |")


if __name__ == "__main__":
    main()
