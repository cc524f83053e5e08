"""Swarms of 24 or more real `lowcomm-node join` daemons on loopback against 8: does a node's
share of the work and its traffic stay flat as the swarm grows?

One run: N daemons of the `tiny` model (a batch of 128 tokens, so that 2 cores carry 24 of them),
each inner step padded to --pace seconds (train.min_step_seconds, node-local), H inner steps a
round, --rounds rounds (--max-steps = rounds × H), all started together (--min-peers N − 1),
each node its own process with its own p2pd. Read from every node's metrics.jsonl:

- NoLoCo: the share of its rounds in which a node applied a partner's snapshot; its swaps per
  round; its failed pairings (a swap that failed, a snapshot that came after its round could use
  it, a pair cancelled) and its rounds with no partner found;
- DiLoCoX: φ by round on every node (rounds whose digests differ, and how many digests), the
  committee (the share of node-rounds that sent a message), bytes per node per round (the
  transport's, and its own messages' payload times the copies sent), the repairs (diverged,
  resync, replay, catch-up, relayed);
- both: DHT traffic per node (below), the transport's bytes, crashes (an exit code other than 0
  or no `left` event), the swarm's peak memory (PSS of the daemons and their p2pd, sampled) and
  CPU seconds per node per round.

DHT traffic: each daemon runs as `python benchmarks/swarm_scale.py --as-node join ...`, which
counts hivemind's DHT RPCs in the daemon's process (unary calls and handlers named
`DHTProtocol.*`: their number, and the protobuf bytes of requests and responses, both ways; no
libp2p framing) and then runs `lowcomm-node join` with those arguments, unchanged (node.cli
main). Its counters go to <data dir>/dht_meter.jsonl every 2 s; a node's rate is taken between
its first and its last round.

    flock /tmp/lowcomm-heavy.lock .venv/bin/python benchmarks/swarm_scale.py --protocol noloco --nodes 8
    flock /tmp/lowcomm-heavy.lock .venv/bin/python benchmarks/swarm_scale.py --protocol noloco --nodes 24
    .venv/bin/python benchmarks/swarm_scale.py --table benchmarks/swarm_scale_noloco_n8.json \\
        benchmarks/swarm_scale_noloco_n24.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.swarm_harness import SwarmHarness, left, phi_rounds, small_manifest  # noqa: E402

DHT_HANDLE = "DHTProtocol."
METER_FILE = "dht_meter.jsonl"
METER_EVERY_S = 2.0
SAMPLE_EVERY_S = 10.0
NOLOCO_FAILED = ("swap_failed", "swap_late", "pair_cancelled")
DILOCOX_REPAIRS = ("diverged", "resync_ready", "replay_ready", "caught_up", "relayed", "missing")


# ---------------------------------------------------------------- in each daemon's process
@dataclass
class DhtCounters:
    """One daemon's DHT RPCs: the calls it made and those it answered."""

    calls_out: int = 0
    calls_in: int = 0
    bytes_sent: int = 0      # requests of its calls, responses to the calls it answered
    bytes_received: int = 0  # responses to its calls, requests of the calls it answered
    by_method: Counter = field(default_factory=Counter)  # rpc_find, rpc_store, rpc_ping, both ways

    def record(self) -> dict:
        return {"time": time.time(), "calls_out": self.calls_out, "calls_in": self.calls_in,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "by_method": dict(self.by_method)}


def install_dht_meter(counters: DhtCounters) -> None:
    """Wraps hivemind's P2P unary protobuf calls and handlers of the DHT protocol to count them.
    Must run before the daemon registers its handlers (it does at start)."""
    from google.protobuf.message import Message
    from hivemind.p2p import P2P
    call, add = P2P.call_protobuf_handler, P2P.add_protobuf_handler

    async def call_protobuf_handler(self, peer_id, name, input, output_protobuf_type):
        if DHT_HANDLE not in name or not isinstance(input, Message):
            return await call(self, peer_id, name, input, output_protobuf_type)
        counters.calls_out += 1
        counters.by_method[name.rsplit(".", 1)[-1]] += 1
        counters.bytes_sent += input.ByteSize()
        response = await call(self, peer_id, name, input, output_protobuf_type)
        counters.bytes_received += response.ByteSize()
        return response

    async def add_protobuf_handler(self, name, handler, input_protobuf_type, **options):
        if DHT_HANDLE in name and not options.get("stream_input") and not options.get("stream_output"):
            inner = handler

            async def handler(request, context):
                counters.calls_in += 1
                counters.by_method[name.rsplit(".", 1)[-1]] += 1
                counters.bytes_received += request.ByteSize()
                response = await inner(request, context)
                counters.bytes_sent += response.ByteSize()
                return response
        return await add(self, name, handler, input_protobuf_type, **options)

    P2P.call_protobuf_handler = call_protobuf_handler
    P2P.add_protobuf_handler = add_protobuf_handler


def run_node(argv: list[str]) -> int:
    """`lowcomm-node <argv>` with the DHT meter on, its counters appended to the data dir."""
    counters = DhtCounters()
    install_dht_meter(counters)
    path = Path(argv[argv.index("--data-dir") + 1]) / METER_FILE
    stop = threading.Event()

    def write() -> None:
        try:
            line = json.dumps(counters.record())
        except RuntimeError:  # a method counted for the first time while copying: next sample
            return
        with open(path, "a") as out:
            out.write(line + "\n")

    def every() -> None:
        while not stop.wait(METER_EVERY_S):
            write()
    threading.Thread(target=every, name="dht-meter", daemon=True).start()
    from node.cli import main
    try:
        return main(argv)
    finally:
        stop.set()
        write()


class MeteredHarness(SwarmHarness):
    """The test harness, each node started through run_node."""

    entry = (str(Path(__file__).resolve()), "--as-node")


# ---------------------------------------------------------------- in the benchmark's process
def _proc_children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """Every SAMPLE_EVERY_S: the PSS of every daemon and its children (p2pd) and their CPU
    seconds; keeps the swarm's peak PSS and, per node, its CPU seconds so far at each sample
    (a process that ended counts with its last reading)."""

    def __init__(self, harness: SwarmHarness):
        super().__init__(name="sampler", daemon=True)
        self.harness, self.stopped = harness, threading.Event()
        self.peak_pss = 0
        self._cpu: dict[tuple[int, int], float] = {}  # (node index, pid): last CPU seconds read
        self.cpu: dict[int, list[tuple[float, float]]] = {}  # node index: [(time, CPU seconds)]

    def sample(self) -> None:
        total, now = 0, time.time()
        for node in list(self.harness.nodes):
            for pid in [node.process.pid, *_proc_children(node.process.pid)]:
                total += _pss_bytes(pid)
                cpu = _cpu_seconds(pid)
                if cpu is not None:
                    self._cpu[(node.index, pid)] = cpu
            seconds = sum(v for (i, _), v in self._cpu.items() if i == node.index)
            self.cpu.setdefault(node.index, []).append((now, seconds))
        self.peak_pss = max(self.peak_pss, total)

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE_EVERY_S):
            self.sample()

    def cpu_window(self, index: int, start: float, end: float) -> float | None:
        """CPU seconds the node used from the last sample at or before `start` to the first at
        or after `end`, scaled to exactly that span."""
        series = self.cpu.get(index, [])
        before = [s for s in series if s[0] <= start]
        after = [s for s in series if s[0] >= end]
        if not before or not after or after[0][0] <= before[-1][0]:
            return None
        (t0, c0), (t1, c1) = before[-1], after[0]
        return (c1 - c0) * (end - start) / (t1 - t0)


def _meter_samples(node) -> list[dict]:
    path = node.data_dir / METER_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dht_window(node, start: float, end: float) -> dict | None:
    """The DHT counters' growth from the last sample at or before `start` to the first at or
    after `end` (the node's first and last round), scaled to exactly that span."""
    samples = _meter_samples(node)
    before = [s for s in samples if s["time"] <= start]
    after = [s for s in samples if s["time"] >= end]
    if not before or not after or after[0]["time"] <= before[-1]["time"]:
        return None
    a, b = before[-1], after[0]
    scale = (end - start) / (b["time"] - a["time"])
    delta = {k: round((b[k] - a[k]) * scale) for k in ("calls_out", "calls_in", "bytes_sent", "bytes_received")}
    delta["by_method"] = {m: round((b["by_method"].get(m, 0) - a["by_method"].get(m, 0)) * scale)
                          for m in b["by_method"]}
    return {"seconds": round(end - start, 1), **delta}


def _log_lines(node, *needles: str, limit: int = 20) -> list[str]:
    path = node.data_dir / "node.log"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line for line in lines if any(n in line for n in needles)][:limit]


def node_record(node, protocol: str, sampler: Sampler, finished: bool) -> dict:
    events = node.events()
    kinds = Counter(e["event"] for e in events)
    rounds = [e for e in events if e["event"] == "round"]
    transport = next((e for e in reversed(events) if e["event"] == "transport"), None)
    record = {"index": node.index, "exit_code": node.process.poll(), "finished": finished,
              "left": left(events), "rounds": len(rounds), "events": dict(kinds),
              "round_seconds_median": round(statistics.median(
                  b["time"] - a["time"] for a, b in zip(rounds, rounds[1:])), 2) if len(rounds) > 2 else None,
              "cpu_seconds": _round(sampler.cpu_window(node.index, rounds[0]["time"], rounds[-1]["time"])
                                    if len(rounds) > 1 else None),
              "transport": {k: transport[k] for k in ("bytes_sent", "bytes_received", "refused_incoming",
                                                      "refused_outgoing")} if transport else None,
              "dht": dht_window(node, rounds[0]["time"], rounds[-1]["time"]) if len(rounds) > 1 else None,
              "window_rounds": max(0, len(rounds) - 1),
              "errors": _log_lines(node, "ERROR", "Traceback", "CRITICAL")}
    if not record["left"] or record["exit_code"] not in (0, None):
        record["log_tail"] = node.log_tail(40).splitlines()
    if protocol == "noloco":
        record.update(paired_rounds=sum(1 for r in rounds if r.get("partner")),
                      swaps=kinds["swapped"], failed_pairings=sum(kinds[k] for k in NOLOCO_FAILED),
                      no_partner=kinds["no_partner"], rested=kinds["rested"],
                      refused=sum(len(r.get("refused", [])) for r in rounds),
                      failures=_log_lines(node, "swap_failed", "pair_cancelled", "no_partner", limit=10))
    else:
        record.update(sent_rounds=sum(1 for r in rounds if r.get("sent_bytes")),
                      payload_sent=sum(e["bytes"] * len(e["group"]) for e in events if e["event"] == "sent"),
                      repairs={k: kinds[k] for k in DILOCOX_REPAIRS},
                      late=rounds[-1].get("late") if rounds else None,
                      refused=sum(len(r.get("refused", [])) for r in rounds),
                      phi={r["round"]: r["phi_digest"] for r in rounds})
    return record


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _spread(values: list[float], digits: int = 3) -> dict:
    if not values:
        return {}
    return {"min": round(min(values), digits), "median": round(statistics.median(values), digits),
            "max": round(max(values), digits)}


def swarm_summary(nodes: list, records: list[dict], protocol: str) -> dict:
    live = [r for r in records if r["rounds"]]
    summary = {
        "crashed": [r["index"] for r in records if not r["left"] or r["exit_code"] not in (0, None)],
        "rounds_per_node": _spread([r["rounds"] for r in records], 0),
        "round_seconds": _spread([r["round_seconds_median"] for r in live if r["round_seconds_median"]], 2),
        "cpu_seconds_per_node_per_round": _spread([r["cpu_seconds"] / r["window_rounds"] for r in live
                                                   if r["cpu_seconds"] is not None and r["window_rounds"]], 2),
        "transport_bytes_sent_per_node_per_round": _spread(
            [r["transport"]["bytes_sent"] / r["rounds"] for r in live if r["transport"]], 0),
        "transport_bytes_received_per_node_per_round": _spread(
            [r["transport"]["bytes_received"] / r["rounds"] for r in live if r["transport"]], 0),
    }
    dht = [r for r in live if r["dht"] and r["window_rounds"]]
    summary["dht_per_node_per_round"] = {
        "calls": _spread([(r["dht"]["calls_out"] + r["dht"]["calls_in"]) / r["window_rounds"] for r in dht], 1),
        "bytes": _spread([(r["dht"]["bytes_sent"] + r["dht"]["bytes_received"]) / r["window_rounds"]
                          for r in dht], 0)}
    summary["dht_bytes_per_node_per_minute"] = _spread(
        [(r["dht"]["bytes_sent"] + r["dht"]["bytes_received"]) * 60 / r["dht"]["seconds"]
         for r in dht if r["dht"]["seconds"]], 0)
    if protocol == "noloco":
        summary.update(
            paired_share=_spread([r["paired_rounds"] / r["rounds"] for r in live]),
            swaps_per_node_per_round=_spread([r["swaps"] / r["rounds"] for r in live]),
            failed_pairings=sum(r["failed_pairings"] for r in records),
            failed_pairings_per_node_per_round=_spread([r["failed_pairings"] / r["rounds"] for r in live]),
            no_partner=sum(r["no_partner"] for r in records),
            rested=sum(r["rested"] for r in records),
            never_paired=[r["index"] for r in records if not r.get("paired_rounds")])
    else:
        common, split, _ = phi_rounds(nodes) if all(r["rounds"] for r in records) else ([], [], [])
        every = sorted(set().union(*(set(r["phi"]) for r in records)))
        by_round = {r: {"nodes": sum(1 for d in records if r in d["phi"]),
                        "digests": len({d["phi"][r] for d in records if r in d["phi"]})} for r in every}
        summary.update(
            rounds_all_ended=len(common), split_rounds=split,
            rounds_one_phi_on_every_node=sum(1 for r in common if r not in split),
            most_digests_in_a_round=max((v["digests"] for v in by_round.values()), default=0),
            phi_by_round=by_round,
            sent_share=_spread([r["sent_rounds"] / r["rounds"] for r in live]),
            payload_bytes_sent_per_node_per_round=_spread([r["payload_sent"] / r["rounds"] for r in live], 0),
            repairs={k: sum(r["repairs"][k] for r in records) for k in DILOCOX_REPAIRS})
    return summary


# ---------------------------------------------------------------- a run
def scale_manifest(protocol: str, inner_steps: int, tokens_per_step: int):
    """The integration tests' swarm (tests/swarm_harness.py small_manifest) on the `tiny`
    preset's model, with a batch of `tokens_per_step` tokens of 32."""
    from node.config.schema import model_preset
    m = small_manifest(f"scale-{protocol}", protocol, inner_steps=inner_steps)
    for key, value in model_preset("tiny").items():
        setattr(m.model, key, value)
    m.data.seq_len = 32
    m.train.micro_batch_size = max(1, min(m.train.micro_batch_size, tokens_per_step // 32))
    m.train.tokens_per_step = tokens_per_step
    return m


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2 ** 20
    return 0.0


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def run(args) -> dict:
    need = args.nodes * args.gib_per_node + args.headroom_gib
    if _available_gib() < need:
        raise SystemExit(f"swarm_scale: {args.nodes} daemons need about {need:.1f} GiB available "
                         f"({args.gib_per_node} each and {args.headroom_gib} for the rest of the "
                         f"machine) and only {_available_gib():.1f} GiB is.")
    manifest = scale_manifest(args.protocol, args.inner_steps, args.tokens_per_step)
    work = Path(args.work or f"/tmp/swarm_scale/{args.protocol}-n{args.nodes}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    extra = ["--max-steps", str(args.rounds * args.inner_steps), "--min-peers", str(args.nodes - 1),
             "--set", f"train.min_step_seconds={args.pace}",
             "--set", f"node.min_peers_timeout_s={args.start_timeout}",
             "--set", f"node.p2pd_start_s={args.p2pd_start_s}"]
    harness = MeteredHarness(work, manifest)
    sampler = Sampler(harness)
    sampler.start()
    started = time.time()
    load_before = os.getloadavg()
    finished: dict[int, bool] = {}
    try:
        nodes = harness.start(args.nodes, extra=extra, timeout=args.start_timeout)
        joined = time.time()
        deadline = joined + args.timeout
        for node in nodes:
            try:
                node.wait_for(left, max(1.0, deadline - time.time()), "its rounds and its exit")
                node.process.wait(timeout=max(1.0, deadline - time.time()))  # it leaves, then exits
                finished[node.index] = True
            except (AssertionError, subprocess.TimeoutExpired) as failure:
                finished[node.index] = False
                print(str(failure).splitlines()[0], file=sys.stderr)
        sampler.sample()
    finally:
        harness.close()
        sampler.stopped.set()
    ended = time.time()
    records = [node_record(n, args.protocol, sampler, finished.get(n.index, False)) for n in harness.nodes]
    for checkpoints in work.glob("node-*/checkpoints"):
        shutil.rmtree(checkpoints, ignore_errors=True)  # the logs and metrics stay, for reading
    return {
        "protocol": args.protocol, "nodes": args.nodes, "rounds": args.rounds,
        "inner_steps": args.inner_steps, "pace_s": args.pace, "tokens_per_step": args.tokens_per_step,
        "model": manifest.model.preset, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "commit": _commit(),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2 ** 30:.0f} GiB",
        "load_before": [round(x, 1) for x in load_before], "load_after": [round(x, 1) for x in os.getloadavg()],
        "start_seconds": round(joined - started, 1), "run_seconds": round(ended - joined, 1),
        "peak_pss_gib": round(sampler.peak_pss / 2 ** 30, 2), "work_dir": str(work),
        "protocol_settings": {k: v for k, v in vars(manifest.protocol).items()},
        "summary": swarm_summary(harness.nodes, records, args.protocol), "per_node": records,
    }


# ---------------------------------------------------------------- the tables
def _kb(spread: dict, key: str = "median") -> str:
    return f"{spread[key] / 1000:,.1f}" if spread else "-"


def table_rows(results: list[dict]) -> list[str]:
    """Markdown rows for benchmarks/RESULTS.md, one per run, a header per protocol."""
    rows, header = [], None
    for r in results:
        s = r["summary"]
        common = (f"| {r['nodes']} | {s['rounds_per_node'].get('median', 0):.0f} | "
                  f"{s['round_seconds'].get('median', '-')} |")
        dht = (f" {s['dht_per_node_per_round']['calls'].get('median', '-')} | "
               f"{_kb(s['dht_per_node_per_round']['bytes'])} |")
        transport = (f" {_kb(s['transport_bytes_sent_per_node_per_round'])} / "
                     f"{_kb(s['transport_bytes_sent_per_node_per_round'], 'max')} |")
        tail = f" {s['cpu_seconds_per_node_per_round'].get('median', '-')} | {r['peak_pss_gib']} | {s['crashed'] or 'none'} |"
        if r["protocol"] == "noloco":
            if header != "noloco":
                rows += ["| nodes | rounds per node | round s | paired share min / median | swaps per node per "
                         "round | failed pairings (per node per round, median) | no partner | DHT RPCs per node "
                         "per round | DHT kB per node per round | transport kB sent per node per round "
                         "median / max | CPU s per node per round | peak PSS GiB | crashed |",
                         "|" + "---|" * 13]
            paired = s["paired_share"]
            rows.append(common + f" {paired.get('min', 0):.0%} / {paired.get('median', 0):.0%} | "
                        f"{s['swaps_per_node_per_round'].get('median', '-')} | {s['failed_pairings']} "
                        f"({s['failed_pairings_per_node_per_round'].get('median', '-')}) | "
                        f"{s['no_partner']} |" + dht + transport + tail)
        else:
            if header != "dilocox":
                rows += ["| nodes | rounds per node | round s | rounds all ended | of them one φ on every "
                         "node | most digests in a round | sent share median | payload kB sent per node "
                         "per round | DHT RPCs per node per round | DHT kB per node per round | transport "
                         "kB sent per node per round median / max | CPU s per node per round | peak PSS "
                         "GiB | crashed |", "|" + "---|" * 14]
            rows.append(common + f" {s['rounds_all_ended']} | {s['rounds_one_phi_on_every_node']} | "
                        f"{s['most_digests_in_a_round']} | {s['sent_share'].get('median', 0):.0%} | "
                        f"{_kb(s['payload_bytes_sent_per_node_per_round'])} |" + dht + transport + tail)
        header = r["protocol"]
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--as-node"]:
        sys.exit(run_node(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=("noloco", "dilocox"), default="noloco")
    parser.add_argument("--nodes", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    parser.add_argument("--pace", type=float, default=1.5, help="seconds an inner step takes at least")
    parser.add_argument("--tokens-per-step", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds from the last join to every node's exit; past it the nodes are stopped")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds for the nodes to join and see each other")
    parser.add_argument("--p2pd-start-s", type=float, default=60.0, help="node.p2pd_start_s")
    parser.add_argument("--gib-per-node", type=float, default=0.5,
                        help="memory a daemon and its p2pd take (PSS; 0.48 GiB measured with 3)")
    parser.add_argument("--headroom-gib", type=float, default=4.0,
                        help="memory left to the rest of the machine: refuse to start without it")
    parser.add_argument("--work", help="the nodes' data dirs (default /tmp/swarm_scale/<protocol>-n<N>)")
    parser.add_argument("--json", help="where the run's JSON goes (default beside this script)")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the runs' table and exit")
    args = parser.parse_args()
    if args.table:
        print("\n".join(table_rows([json.loads(Path(p).read_text()) for p in args.table])))
        return
    if args.nodes < 2:
        parser.error("--nodes must be at least 2: a swarm of one exchanges nothing")
    result = run(args)
    out = Path(args.json or Path(__file__).with_name(f"swarm_scale_{args.protocol}_n{args.nodes}.json"))
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(table_rows([result])))
    print(f"{out}: start {result['start_seconds']} s, run {result['run_seconds']} s, "
          f"crashed {result['summary']['crashed'] or 'none'}, logs in {result['work_dir']}")


if __name__ == "__main__":
    main()
