"""Does NoLoCo's gap to DiLoCo close with groups larger than a pair? (issue 19, an experiment)

The N × H grid (benchmarks/noloco_grid.py) has NoLoCo 4.4% above DiLoCo at N = 4 and 6.8-8.7%
at N = 8; pairs drawn on a hypercube (which average over 2^k members in k rounds) did not
change that (+0.18%, benchmarks/grid_runs/N8-H25-noloco-new-hc-s0.json). What grows with N in
DiLoCo and not in a pair is how many replicas' progress each outer step averages. docs/protocols.md
§1 allows a group G of any size n; this measures the update with n ∈ {2, 4, 8} before anyone
builds asynchronous group matching: every round a shared random permutation cuts the replicas
into groups of n (the paper's own scheme), each member applies protocol/noloco.py's outer step
with its group's snapshots of this round (blocking timing, exact fp32 θ: the group size alone
changes; `--wire-dtype int8|int4` passes each θ through the daemon's encoding instead), on the
grid's budget (benchmarks/grid_jobs.py). Bytes: a member sends its θ to the n − 1 others,
(n − 1) · 1.06 bytes a parameter in int8 (0.56 in int4), against the fp32 ring's 2(N − 1)/N · 4.

    .venv/bin/python benchmarks/noloco_groups.py --workers 8 --inner-steps 25 --group 4 --seed 0

`--swaps k` replaces the groups by what the daemon's pairwise swaps could give: each member
swaps with k partners a round (k random perfect matchings that repeat no pair) and averages
with them, so neighbourhoods overlap instead of partitioning the swarm; it sends k θ a round.

Writes benchmarks/grid_runs/N<N>-H<H>-noloco-groups<n>[-a<α>-g<β>]-s<seed>.json (the grid's
format; its `settings` are those of the local-only job whose budget and evaluation it borrows,
`job.method` names what ran).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from grid_jobs import Job  # noqa: E402
from convergence import node_config, parse_args as convergence_args  # noqa: E402
from node.data.corpus import load_corpus  # noqa: E402
from node.simulator.methods.base import Method  # noqa: E402
from node.simulator.runner import Simulation  # noqa: E402
import torch  # noqa: E402

from node.rounds.noloco.payload import decode_snapshot, encode_snapshot  # noqa: E402
from node.simulator.exchange import InMemoryMessage  # noqa: E402
from protocol.noloco import NoLoCo, NoLoCoHyperParameters, theta_only_snapshot  # noqa: E402


class NoLoCoGroups(Method):
    """Blocking NoLoCo where a shared permutation cuts the replicas into groups of `group`."""

    def __init__(self, settings, replicas, exchange, group: int, hyper: NoLoCoHyperParameters,
                 wire_dtype: str = "fp32", swaps: int = 0, stochastic: bool = False) -> None:
        super().__init__(settings, replicas, exchange)
        self.group, self.hyper, self.wire_dtype, self.swaps = group, hyper, wire_dtype, swaps
        # the daemon's stochastic rounding: each member its own seeded generator
        self.rounding = {r.name: torch.Generator().manual_seed(settings.seed * 1000 + i)
                         for i, r in enumerate(replicas)} if stochastic else {}
        self.outer = {r.name: NoLoCo(r.trainer.named_parameters(), hyper) for r in replicas}
        self.permutation = random.Random(settings.seed)

    def run_round(self, round_index: int) -> None:
        self.inner_phase()
        snapshots = {r.name: self.outer[r.name].snapshot(r.trainer.named_parameters())
                     for r in self.replicas}
        received = snapshots if self.wire_dtype == "fp32" else \
            {name: self._through_the_wire(s, round_index, name) for name, s in snapshots.items()}
        by_name = {r.name: r for r in self.replicas}
        for name, others in self.partners(sorted(snapshots)).items():
            partners = [received[other] for other in others]
            by_name[name].load(self.outer[name].outer_step(snapshots[name], partners))

    def partners(self, names: list[str]) -> dict[str, list[str]]:
        """Each member's partners this round: the others of its group (a shared permutation
        cut into groups of `group`), or, with `swaps`, the partners of `swaps` random perfect
        matchings drawn one after another without repeating a pair (what `swaps` pairwise swaps
        a round would give a node: a neighbourhood, not a group all of whose members average
        the same snapshots)."""
        if not self.swaps:
            self.permutation.shuffle(names)
            groups = [names[i:i + self.group] for i in range(0, len(names), self.group)]
            return {name: [o for o in members if o != name] for members in groups for name in members}
        partners: dict[str, list[str]] = {name: [] for name in names}
        for _ in range(self.swaps):
            while True:  # a matching that repeats no pair of this round
                order = list(names)
                self.permutation.shuffle(order)
                pairs = [(order[i], order[i + 1]) for i in range(0, len(order) - 1, 2)]
                if all(b not in partners[a] for a, b in pairs):
                    break
            for a, b in pairs:
                partners[a].append(b)
                partners[b].append(a)
        return partners


    def _through_the_wire(self, snapshot, round_index: int, sender: str):
        """What a member receives of `sender`'s snapshot: its θ encoded as the daemon encodes it
        and decoded (node/rounds/noloco/payload.py), applied as the snapshot (θ, 0)."""
        shapes = {name: tuple(t.shape) for name, t in snapshot.slow_weights.items()}
        message = InMemoryMessage(round_index, encode_snapshot(snapshot, self.wire_dtype, "theta",
                                                               self.rounding.get(sender)))
        theta = decode_snapshot(message, "theta", sender, self.wire_dtype, shapes)["theta"]
        return theta_only_snapshot(theta, self.hyper)


def merged_val_loss(replicas) -> float:
    """A diagnostic, not a result: the validation loss of the replicas' mean weights at the end.
    NoLoCo's replicas never agree exactly; if their mean scored near DiLoCo, the gap would be the
    replicas' disagreement (more mixing would close it), not the progress each outer step makes."""
    weights = [r.weights() for r in replicas]
    mean = {name: sum(w[name] for w in weights) / len(weights) for name in weights[0]}
    first = replicas[0]
    own = first.weights()
    first.load(mean)
    loss = first.trainer.evaluate()
    first.load(own)
    return loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.5, help="α, NoLoCo's outer momentum")
    p.add_argument("--beta", type=float, default=0.7, help="β = γ")
    p.add_argument("--wire-dtype", default="fp32", choices=("fp32", "bf16", "int8", "int4"),
                   help="θ as the daemon sends it (fp32: exact, the partners' own snapshots)")
    p.add_argument("--stochastic-rounding", action="store_true",
                   help="round θ on the wire stochastically, as the daemon's wire_rounding = "
                   "\"stochastic\" does (each member its own seeded generator); to nearest otherwise")
    p.add_argument("--swaps", type=int, default=0,
                   help="instead of groups: this many pairwise swaps a round per member, each "
                   "averaging with its partners (a neighbourhood of swaps + 1; --group is ignored)")
    p.add_argument("--jobs-dir", type=Path, default=HERE / "grid_runs")
    args = p.parse_args(argv)
    job = Job(args.workers, args.inner_steps, "local", args.seed)  # the grid's budget and evaluation
    config = node_config(convergence_args([]))
    simulation = Simulation(job.settings(), config, load_corpus(config.data))
    method = simulation.method
    hyper = NoLoCoHyperParameters(args.alpha, args.beta, args.beta)
    simulation.method = NoLoCoGroups(method.settings, method.replicas, method.exchange, args.group, hyper,
                                     args.wire_dtype, args.swaps, args.stochastic_rounding)
    result = simulation.run()
    merged = merged_val_loss(simulation.method.replicas)
    tuned = "" if (args.alpha, args.beta) == (0.5, 0.7) else f"-a{args.alpha}-g{args.beta}"
    wire = ("" if args.wire_dtype == "fp32" else f"-{args.wire_dtype}") + ("-sr" if args.stochastic_rounding else "")
    name = f"noloco-swaps{args.swaps}{tuned}{wire}" if args.swaps else f"noloco-groups{args.group}{tuned}{wire}"
    key = f"N{args.workers}-H{args.inner_steps}-{name}-s{args.seed}"
    data = {"job": {**job.__dict__, "method": name}, **result.to_dict(), "merged_val_loss": merged}
    (args.jobs_dir / f"{key}.json").write_text(json.dumps(data) + "\n", encoding="utf-8")
    print(f"{key}: {result.final_val_loss:.4f}, the replicas' mean model {merged:.4f} "
          f"({result.final.wall_seconds / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
