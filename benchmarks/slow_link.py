"""One node whose exchange outlasts a round: does it stay busy, still exchange, and leave the
others' pace alone? NoLoCo (issue 19: it pairs less often) or DiLoCoX with its controller on
(issue 18: it compresses harder).

Two 4-node swarms of `lowcomm-node join` daemons run side by side on one shaped network (each
node in its own namespace, benchmarks/netns.py), so that both see the same load on this shared
machine: the base swarm with every access link at --rate, and the test swarm where one node's
link is --slow-rate, slow enough that its swap (θ in bf16, both ways) takes longer than its
round. Per node: rounds per minute, rounds in which it applied a partner's snapshot (pairs),
rounds it rested (node/rounds/noloco/pacing.py), the pairing interval it chose, and its idle
fraction (time the training thread waited on the network over the run's wall clock).
DiLoCoX (`--protocol dilocox`): the codec starts weak (low-rank at --rank, 8 bits, so that the
slow node's message to its three members outlasts a round) and the controller adapts it; per
node the rank and bits it chose each round, bytes sent a round, the members' messages it
applied, messages missing at a round's end, and whether every node's φ digest agreed.

    sudo .venv/bin/python benchmarks/slow_link.py                   # ~8 min
    sudo .venv/bin/python benchmarks/slow_link.py --max-swap-rounds 1   # pacing off, for contrast
    sudo .venv/bin/python benchmarks/slow_link.py --protocol dilocox --rank 16 --slow-rate 512kbit \
        --steps 100 --inner-steps 5 --out benchmarks/slow_link_dilocox.json     # ~5 min

Writes benchmarks/slow_link.json (or --out) and prints the table for benchmarks/NOTEBOOK.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.netns import ShapedSwarm  # noqa: E402
from benchmarks.time_to_loss import (P2P_PORT, PYTHON, RELAY_PORT, read_events, tiny_manifest,  # noqa: E402
                                     wait_all, wait_for_file)
from node.config.manifest import Manifest, write_manifest  # noqa: E402

SWARMS = ("base", "slow")  # nodes 0-3 and 4-7; the last node of "slow" has the slow link


def swarm_manifest(name: str, args) -> Manifest:
    manifest = tiny_manifest(args.protocol, args.steps, 0, args.threads)
    manifest.swarm.id = f"slow-link-{name}"
    p = manifest.protocol
    p.inner_steps = args.inner_steps
    if args.protocol == "noloco":
        p.max_swap_rounds = args.max_swap_rounds
    else:  # the time-to-loss settings (benchmarks/time_to_loss.py method_manifest), a weak start
        p.codec, p.rank, p.bits, p.apply_on_arrival, p.outer_momentum = "lowrank", args.rank, 8, True, 0.6
        p.controller = True
    return manifest


def start_swarm(net: ShapedSwarm, base: Path, name: str, nodes: range, args) -> list[subprocess.Popen]:
    path = write_manifest(swarm_manifest(name, args), base / name / "manifest.toml")
    processes, first_address = [], None
    for i in nodes:
        data_dir = base / name / f"node-{i}"
        data_dir.mkdir(parents=True)
        net.relay(i, RELAY_PORT, ("127.0.0.1", P2P_PORT))
        command = [PYTHON, "-m", "node.cli", "join", "--manifest", str(path), "--data-dir", str(data_dir),
                   "--listen", f"/ip4/127.0.0.1/tcp/{P2P_PORT}",
                   "--announce", f"/ip4/{net.address(i)}/tcp/{RELAY_PORT}", "--max-steps", str(args.steps)]
        command += ["--min-peers", str(len(nodes) - 1)] if first_address is None else ["--peer", first_address]
        with open(data_dir / "node.log", "wb") as log:
            processes.append(net.popen(i, command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        if first_address is None:
            first_address = wait_for_file(data_dir / "address", processes, 120)
    return processes


def node_summary(events: list[dict]) -> dict:
    rounds = [e for e in events if e["event"] == "round"]
    start = next(e["time"] for e in events if e["event"] == "joined")
    end = next(e["time"] for e in reversed(events) if e["event"] in ("trained", "left"))
    # rounds per minute between the first round's end and the last's: the swarm's pace, not
    # the start-up (p2pd, the wait for peers) or the final evaluation
    span = rounds[-1]["time"] - rounds[0]["time"] if len(rounds) > 1 else float("nan")
    paced = [e["interval"] for e in events if e["event"] == "pairing_paced"]
    return {"rounds": len(rounds), "rounds_per_minute": 60 * (len(rounds) - 1) / span,
            "pairs": sum(1 for e in rounds if e.get("partner")),
            "rested": sum(1 for e in events if e["event"] == "rested"),
            "intervals": paced, "swaps_late": sum(1 for e in events if e["event"] == "swap_late"),
            "swaps_failed": sum(1 for e in events if e["event"] == "swap_failed"),
            "idle_fraction": sum(e.get("network_wait_seconds", 0.0) for e in rounds) / (end - start),
            "final_train_loss": next((e["loss"] for e in reversed(events) if e["event"] == "step"), None),
            **({"dilocox": dilocox_summary(rounds, events)} if rounds and "sent_bytes" in rounds[-1] else {})}


def dilocox_summary(rounds: list[dict], events: list[dict]) -> dict:
    """What DiLoCoX's controller chose each round, what it sent, and whom it applied."""
    choices = [e.get("compression") or {} for e in rounds]
    return {"rank_by_round": [c.get("rank_max") for c in choices],
            "bits_by_round": [c.get("bits") for c in choices],
            "send_ratio_by_round": [c.get("send_ratio") for c in choices],
            "sent_bytes_by_round": [e["sent_bytes"] for e in rounds],
            "applied_senders_by_round": [len(e.get("group") or []) for e in rounds],
            "digests": {e["round"]: e["phi_digest"] for e in rounds},
            "missing": sum(len(e.get("peers") or []) for e in events if e["event"] == "missing"),
            "resyncs": rounds[-1].get("resyncs", 0), "replays": rounds[-1].get("replays", 0)}


def digests_agree(nodes: list[dict]) -> tuple[int, int]:
    """(rounds on which every node reported the same φ digest, rounds every node reported)."""
    maps = [n["dilocox"]["digests"] for n in nodes]
    common = set.intersection(*(set(m) for m in maps))
    return sum(len({m[r] for m in maps}) == 1 for r in common), len(common)


def report_dilocox(results: dict, args) -> str:
    lines = ["| swarm | node | link | rounds/min | vs base (same node) | rank chosen (first, last, min) | "
             "bits (last) | sent a round (first, last) | senders applied (mean) | missing | resyncs | "
             "replays | idle |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in SWARMS:
        for k, node in enumerate(results[name]):
            d, base = node["dilocox"], results["base"][k]["rounds_per_minute"]
            ranks = [r for r in d["rank_by_round"] if r is not None]
            chosen = f"{ranks[0]}, {ranks[-1]}, {min(ranks)}" if ranks else "-"
            sent = d["sent_bytes_by_round"]
            link = args.slow_rate if name == "slow" and k == 3 else args.rate
            lines.append(
                f"| {name} | {k} | {link} | {node['rounds_per_minute']:.2f} | "
                f"{100 * (node['rounds_per_minute'] / base - 1):+.1f}% | {chosen} | "
                f"{d['bits_by_round'][-1]} | {sent[0] / 1024:.0f}, {sent[-1] / 1024:.0f} KiB | "
                f"{statistics.fmean(d['applied_senders_by_round']):.2f} | {d['missing']} | {d['resyncs']} | "
                f"{d.get('replays', 0)} | "
                f"{100 * node['idle_fraction']:.2f}% |")
    for name in SWARMS:
        agreed, common = digests_agree(results[name])
        lines.append(f"\n{name}: every node's φ digest equal on {agreed} of {common} rounds")
    return "\n".join(lines)


def report(results: dict, args) -> str:
    if args.protocol == "dilocox":
        return report_dilocox(results, args)
    lines = ["| swarm | node | link | rounds/min | vs base (same node) | pairs | rested | intervals chosen | "
             "idle | swaps late / failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in SWARMS:
        for k, node in enumerate(results[name]):
            base = results["base"][k]["rounds_per_minute"]
            link = args.slow_rate if name == "slow" and k == 3 else args.rate
            lines.append(
                f"| {name} | {k} | {link} | {node['rounds_per_minute']:.2f} | "
                f"{100 * (node['rounds_per_minute'] / base - 1):+.1f}% | {node['pairs']} of {node['rounds']} | "
                f"{node['rested']} | {node['intervals'] or '-'} | {100 * node['idle_fraction']:.2f}% | "
                f"{node['swaps_late']} / {node['swaps_failed']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--protocol", choices=("noloco", "dilocox"), default="noloco")
    p.add_argument("--rank", type=int, default=16, help="DiLoCoX: the low-rank codec's starting rank")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--slow-rate", default="1mbit")
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-swap-rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "slow_link.json")
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lowcomm-slow-") as tmp:
        base = args.work_dir or Path(tmp)
        with ShapedSwarm(n=8, rate=args.rate, delay_ms=args.delay_ms, rates={7: args.slow_rate}) as net:
            started = time.time()
            processes = [p for name, nodes in zip(SWARMS, (range(0, 4), range(4, 8)))
                         for p in start_swarm(net, base, name, nodes, args)]
            wait_all(processes, timeout=3600)
            wall = time.time() - started
        results = {name: [node_summary(read_events(base / name / f"node-{i}" / "metrics.jsonl"))
                          for i in nodes] for name, nodes in zip(SWARMS, (range(0, 4), range(4, 8)))}
    table = report(results, args)
    others = [results["slow"][k]["rounds_per_minute"] / results["base"][k]["rounds_per_minute"] for k in range(3)]
    summary = {"args": vars(args) | {"out": str(args.out), "work_dir": str(args.work_dir)}, "wall_s": wall,
               "results": results, "others_pace_vs_base": others,
               "others_pace_vs_base_mean": statistics.fmean(others)}
    if args.protocol == "dilocox":
        summary["digests_agree"] = {name: digests_agree(results[name]) for name in SWARMS}
    args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(table)
    print(f"wall {wall / 60:.1f} min; the slow swarm's other nodes' pace against the base's: "
          + ", ".join(f"{100 * (r - 1):+.1f}%" for r in others))


if __name__ == "__main__":
    main()
