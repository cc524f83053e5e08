"""Sync time per round against swarm size on shaped links, and each method's physical bound
(issue 7, measurement 1).

    sudo .venv/bin/python benchmarks/sync_time.py                 # N = 2,4,8; two links; 25M
    sudo .venv/bin/python benchmarks/sync_time.py --sizes 2 --links 20mbit:50 --params 1e6
    sudo .venv/bin/python benchmarks/sync_time.py --methods noloco --snapshot phi_delta --resume

Each node sits in its own namespace of a ShapedSwarm (benchmarks/netns.py: tbf on both ends of
its access link, a delaying relay in front of its listener) and exchanges a synthetic payload of
`--params` parameters (square fp32 matrices of `--dim`), with no training, `--rounds` times.
Our two protocols run as a daemon does (node/daemon/join.py connect, leave.py leave, the
exchange of build_exchange) on the default manifest (node/config/manifest.py), changed only to
blocking timing, and send what the daemon's round encodes (node/rounds/<protocol>/payload.py):
- `noloco`: our NoLoCo swap, NoLoCoExchange in blocking timing: the snapshot protocol.snapshot
  names (`--snapshot`: θ alone by default, or φ and Δ, twice the bytes; results say
  noloco-theta or noloco-phi_delta) in the manifest's wire dtype and rounding (int4, stochastic
  since 2026-11-27; each result says which, `wire`), paired by the random
  matching, one swap per pair; a node left unpaired ends its round at the manifest's pair
  deadline (60 s): such rounds are left out of the median and counted apart (`paired`);
- `dilocox`: our DiLoCoX exchange, DiLoCoXExchange: the message of the manifest's codec (low-rank,
  rank 4, 8-bit) pushed to every other member; the round ends when this node has sent its
  message and received all of theirs;
- `hivemind`: hivemind's DecentralizedAverager all-reduce of the fp32 payload (fp16 with
  `hivemind-fp16`), matchmaking scheduled ahead so that only the all-reduce is timed;
- `gloo`: torch.distributed all_reduce (gloo) of the fp32 payload. gloo opens its own
  connections on ports it picks, so no relay sits in front of them: its traffic is shaped but
  gets no added latency, which favours it.
Rounds start together (the orchestrator hands out a start time); a node's sync time is from the
round's start to its exchange's end. Round 0 warms connections up and is not reported. Bytes are
the node's eth0 tx counter over the round. The bound: the bytes a node must send over its link
rate plus one round trip (2 x the one-way delay).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.netns import rate_bits  # noqa: E402
from node.config.manifest import Manifest  # noqa: E402
P2P_PORT, RELAY_PORT, GLOO_PORT = 4100, 4101, 29500
METHODS = ("noloco", "dilocox", "hivemind", "hivemind-fp16", "gloo")
ROUND_TIMEOUT_S = 600.0
START_LEAD_S = {"hivemind": 8.0, "hivemind-fp16": 8.0}  # matchmaking happens in the lead


def payload(params: int, dim: int) -> dict[str, torch.Tensor]:
    count = max(1, round(params / (dim * dim)))
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(dim, dim, generator=generator) for i in range(count)}


def tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def next_round() -> tuple[int, float] | None:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if not line.strip():
        return None
    index, start = line.split()
    return int(index), float(start)


async def until(start: float) -> None:
    await asyncio.sleep(max(0.0, start - time.time()))


# ---------------------------------------------------------------------------- our protocols

def bench_manifest(method: str, snapshot: str):
    """The default manifest, changed only where this benchmark must: its own swarm, the method's
    protocol, NoLoCo's snapshot layout, and blocking timing (the round waits for its swap, so
    the swap is what gets timed)."""
    from node.config.manifest import check_snapshot
    m = Manifest()
    m.swarm.id = "sync-time"
    m.protocol.name, m.protocol.timing, m.protocol.snapshot = method, "blocking", snapshot
    check_snapshot(m.protocol, m.contributions)
    return m


def encode_round(manifest, peer_id: str, tensors: dict[str, torch.Tensor]) -> list:
    """What a daemon's round hands its exchange, by its payload module, for `tensors` as the
    round's weights (NoLoCo: φ = Δ = them; DiLoCoX: the pseudo-gradient)."""
    config = manifest.protocol
    if config.name == "noloco":
        from node.rounds.noloco.payload import encode_snapshot
        from protocol.noloco import NoLoCoSnapshot
        rounding = torch.Generator().manual_seed(0) if config.wire_rounding == "stochastic" else None
        return encode_snapshot(NoLoCoSnapshot(slow_weights=tensors, local_progress=tensors),
                               config.wire_dtype, config.snapshot, rounding)
    from node.rounds.dilocox.payload import encode_message
    from node.rounds.dilocox.round import codec_for
    from protocol.dilocox import DiLoCoX
    outer = DiLoCoX({k: torch.zeros_like(v) for k, v in tensors.items()}, codec_for(config), peer_id)
    return encode_message(outer.compress(tensors, 0))


async def run_ours(args: argparse.Namespace) -> None:
    """One node as a daemon runs it (node/daemon/join.py connect, leave.py leave), timing its
    exchange alone: NoLoCo's `finish_round`, DiLoCoX's send to the group and the group's arrival."""
    from node.config.settings import NodeSettings
    from node.daemon.daemon import Daemon, build_exchange
    from node.daemon.join import connect
    from node.daemon.leave import leave
    from node.rounds.dilocox.sending import PGRAD
    from p2p.identity import NodeIdentity
    from p2p.messages import OutgoingMessage

    loop = asyncio.get_running_loop()
    manifest = bench_manifest(args.method, args.snapshot)
    data_dir = tempfile.TemporaryDirectory(prefix="lowcomm-sync-")
    settings = NodeSettings(Path(data_dir.name), listen=[f"/ip4/127.0.0.1/tcp/{P2P_PORT}"],
                            announce=[f"/ip4/{args.address}/tcp/{RELAY_PORT}"], peers=args.peer)
    node = Daemon(manifest, settings)  # holds what connect starts, for leave to stop
    node.bind_loop()
    node.events.subscribe(lambda event: print(json.dumps(event.record(), default=str),
                                              file=sys.stderr, flush=True))  # the worker's log
    try:
        swarm = await connect(node, NodeIdentity.load_or_create(node.data_dir.identity))
        say(event="address", address=(await node.network.host.maddrs())[0])
        while len(swarm.members.eligible()) < args.n - 1:
            swarm.members.refreshed.clear()
            await asyncio.wait_for(swarm.members.refreshed.wait(), 60)
        exchange = node.network.exchange = build_exchange(manifest.protocol, swarm, settings.seed)
        message = encode_round(manifest, swarm.peer_id, payload(args.params, args.dim))
        exchange.start(0)
        say(event="ready", message_bytes=sum(memoryview(t.data).nbytes for t in message))
        deadline = manifest.protocol.pair_deadline_s  # what a daemon waits for a partner
        while (order := await next_round()) is not None:
            index, start = order
            await until(start)
            if args.method == "dilocox":  # signed as send_round signs it, before the clock starts
                outgoing = OutgoingMessage(PGRAD, index, message)
                exchange.relay.sign(outgoing)
            sent_before, began = tx_bytes(), time.monotonic()
            if args.method == "noloco":
                partner = await loop.run_in_executor(None, exchange.finish_round, index, message,
                                                     deadline)
                done = {"paired": partner is not None}
            else:  # what send_round starts in the background, awaited here
                await exchange.sender._send_all(index, outgoing)
                while len(exchange.inbox.get(index, {})) < args.n - 1:
                    exchange.arrived.clear()
                    await asyncio.wait_for(exchange.arrived.wait(), ROUND_TIMEOUT_S)
                done = {"received": len(exchange.inbox.pop(index))}
            say(event="round", round=index, seconds=time.monotonic() - began,
                tx_bytes=tx_bytes() - sent_before, **done)
    finally:
        await leave(node)
        data_dir.cleanup()


# ---------------------------------------------------------------------------- baselines

def run_hivemind(args: argparse.Namespace) -> None:
    import hivemind
    from hivemind.compression import Float16Compression, NoCompression
    from hivemind.utils import get_dht_time

    dht = hivemind.DHT(start=True, initial_peers=args.peer, use_ipfs=False, nat_port_map=False,
                       host_maddrs=[f"/ip4/127.0.0.1/tcp/{P2P_PORT}"],
                       announce_maddrs=[f"/ip4/{args.address}/tcp/{RELAY_PORT}"])
    say(event="address", address=str(dht.get_visible_maddrs()[0]))
    tensors = list(payload(args.params, args.dim).values())
    averager = hivemind.DecentralizedAverager(
        tensors, dht, start=True, prefix="sync-time", target_group_size=args.n, min_group_size=args.n,
        min_matchmaking_time=4.0, request_timeout=3.0,
        compression=Float16Compression() if args.method == "hivemind-fp16" else NoCompression())
    say(event="ready", message_bytes=sum(t.numel() for t in tensors) * (2 if "fp16" in args.method else 4))
    try:
        while line := sys.stdin.readline().strip():
            index, start = int(line.split()[0]), float(line.split()[1])
            control = averager.step(scheduled_time=start - time.time() + get_dht_time(), wait=False,
                                    require_trigger=True, timeout=ROUND_TIMEOUT_S)
            time.sleep(max(0.0, start - time.time()))
            sent_before, began = tx_bytes(), time.monotonic()
            control.allow_allreduce()
            group = control.result(timeout=ROUND_TIMEOUT_S)
            say(event="round", round=index, seconds=time.monotonic() - began,
                tx_bytes=tx_bytes() - sent_before, group=len(group or ()))
    finally:
        averager.shutdown()
        dht.shutdown()


def run_gloo(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{GLOO_PORT}",
                            rank=args.index, world_size=args.n)
    flat = torch.cat([t.reshape(-1) for t in payload(args.params, args.dim).values()])
    say(event="ready", message_bytes=flat.nbytes)
    try:
        while line := sys.stdin.readline().strip():
            index, start = int(line.split()[0]), float(line.split()[1])
            time.sleep(max(0.0, start - time.time()))
            sent_before, began = tx_bytes(), time.monotonic()
            dist.all_reduce(flat)
            say(event="round", round=index, seconds=time.monotonic() - began,
                tx_bytes=tx_bytes() - sent_before)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- orchestration

class Worker:
    def __init__(self, process: subprocess.Popen, log):
        self.process, self.log = process, log  # the log gets its stderr and every stdout line

    def expect(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            self.log.write(line)
            if not line:
                raise RuntimeError(f"a worker exited (code {self.process.wait()}) before `{event}`")
            if line.startswith("{") and (record := json.loads(line))["event"] == event:
                return record
        raise TimeoutError(f"no `{event}` from a worker within {timeout:.0f} s")


def measure(swarm, method: str, args: argparse.Namespace) -> list[list[dict]]:
    """Rounds of every node of one method on `swarm`: rows[round][node]."""
    workers, first = [], None
    logs = Path(tempfile.gettempdir()) / "lowcomm-sync-time-logs"  # each worker's events and stderr
    logs.mkdir(exist_ok=True)
    for i in range(swarm.n):
        command = [sys.executable, __file__, "worker", "--method", method, "--index", str(i),
                   "--n", str(swarm.n), "--address", swarm.address(i), "--master", swarm.address(0),
                   "--params", str(args.params), "--dim", str(args.dim), "--snapshot", args.snapshot]
        if method != "gloo":
            swarm.relay(i, RELAY_PORT, ("127.0.0.1", P2P_PORT))
            command += ["--peer", first] if first else []
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        log = open(logs / f"{swarm.rate}-n{swarm.n}-{label(method, args.snapshot)}-{i}.log", "w",
                   buffering=1)
        process = swarm.popen(i, command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                              text=True, bufsize=1, cwd=REPO, env=env)
        workers.append(Worker(process, log))
        if method != "gloo" and i == 0:
            first = workers[0].expect("address", 120)["address"]
    ready = [w.expect("ready", 300) for w in workers]
    rows = []
    for index in range(args.rounds + 1):
        start = time.time() + 1.0 + START_LEAD_S.get(method, 0.0)
        for w in workers:
            w.process.stdin.write(f"{index} {start}\n")
            w.process.stdin.flush()
        rows.append([w.expect("round", ROUND_TIMEOUT_S) | {"message_bytes": r["message_bytes"]}
                     for w, r in zip(workers, ready)])
    for w in workers:
        w.process.stdin.close()
    for w in workers:
        w.process.wait(timeout=60)
        w.log.close()
    return rows[1:]  # round 0 warms up connections


def must_send(method: str, n: int, message_bytes: int) -> float:
    """Bytes a node must put on its link per round, by the method's own algorithm."""
    if method.startswith("noloco"):
        return message_bytes                       # its snapshot, to its one partner
    if method == "dilocox":
        return message_bytes * (n - 1)             # its message, to every other member
    return 2 * (n - 1) / n * message_bytes          # a bandwidth-optimal all-reduce


def label(method: str, snapshot: str | None) -> str:
    """A method as results name it: NoLoCo with its snapshot layout (noloco-theta, ...)."""
    return f"{method}-{snapshot}" if method == "noloco" else method


def summarize(method: str, n: int, rate: str, delay_ms: float, rows: list[list[dict]],
              snapshot: str) -> dict:
    message = rows[0][0]["message_bytes"]
    bound = must_send(method, n, message) * 8 / rate_bits(rate) + 2 * delay_ms / 1000
    times = [r["seconds"] for row in rows for r in row if r.get("paired", True)]
    sync = statistics.median(times) if times else float("nan")
    summary = {"method": label(method, snapshot), "n": n, "rate": rate, "delay_ms": delay_ms,
               "sync_seconds": sync, "sync_seconds_max": max(times, default=float("nan")),
               "sync_seconds_all": [[r["seconds"] for r in row] for row in rows],
               "tx_bytes_per_node": statistics.median(r["tx_bytes"] for row in rows for r in row),
               "message_bytes": message, "bound_seconds": bound, "ratio_to_bound": sync / bound,
               "load_average": os.getloadavg()[0]}
    if method == "noloco":
        config = bench_manifest(method, snapshot).protocol
        summary["snapshot"] = snapshot
        summary["wire"] = f"{config.wire_dtype}, rounding {config.wire_rounding}"
        summary["paired_fraction"] = len(times) / sum(len(row) for row in rows)
    return summary


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = sorted({(r["rate"], r["delay_ms"]) for r in results}, key=lambda x: rate_bits(x[0]))
    figure, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    for axis, (rate, delay) in zip(axes[0], links):
        for method in dict.fromkeys(r["method"] for r in results):
            rows = sorted((r for r in results if r["method"] == method and r["rate"] == rate
                           and r["delay_ms"] == delay), key=lambda r: r["n"])
            line, = axis.plot([r["n"] for r in rows], [r["sync_seconds"] for r in rows], "o-", label=method)
            axis.plot([r["n"] for r in rows], [r["bound_seconds"] for r in rows], ":", color=line.get_color())
        axis.set(title=f"{rate}, {delay:.0f} ms one way (dotted: bound)", xlabel="nodes N",
                 ylabel="sync time per round (s)", yscale="log")
        axis.set_xticks(sorted({r["n"] for r in results}))
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
    lines = ["| link | N | method | sync s: median (slowest) | bound s | ratio | tx MB/node/round | message MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        extra = f" ({r['paired_fraction']:.0%} paired)" if "paired_fraction" in r else ""
        lines.append(f"| {r['rate']} {r['delay_ms']:.0f} ms | {r['n']} | {r['method']}{extra} | "
                     f"{r['sync_seconds']:.2f} ({r.get('sync_seconds_max', float('nan')):.2f}) | {r['bound_seconds']:.2f} | {r['ratio_to_bound']:.2f} | "
                     f"{r['tx_bytes_per_node'] / 1e6:.1f} | {r['message_bytes'] / 1e6:.2f} |")
    return "\n".join(lines)


def orchestrate(args: argparse.Namespace) -> None:
    from benchmarks.netns import ShapedSwarm
    from p2p.host import dead_sockets_removed
    results = json.loads(args.out.read_text())["results"] if args.resume and args.out.exists() else []
    done = {(r["rate"], r["delay_ms"], r["n"], r["method"]) for r in results}
    for link in args.links.split(","):
        rate, delay = link.split(":")
        for n in (int(x) for x in args.sizes.split(",")):
            for method in args.methods.split(","):
                if (rate, float(delay), n, label(method, args.snapshot)) in done:
                    continue
                # hivemind's DHT leaves its client sockets behind: ours, once dead, are removed
                with dead_sockets_removed(), ShapedSwarm(n=n, rate=rate, delay_ms=float(delay)) as swarm:
                    rows = measure(swarm, method, args)
                results.append(summarize(method, n, rate, float(delay), rows, args.snapshot))
                r = results[-1]
                print(f"{rate} {delay} ms N={n} {r['method']}: {r['sync_seconds']:.2f} s "
                      f"(bound {r['bound_seconds']:.2f}, x{r['ratio_to_bound']:.2f})", flush=True)
                args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "results": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(table(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", choices=["orchestrate", "worker"], default="orchestrate")
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--links", default="100mbit:50,1gbit:10", help="rate:one-way-ms,...")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--params", type=float, default=25e6, help="payload parameters (default 25M)")
    parser.add_argument("--dim", type=int, default=1024, help="the payload's matrices are dim x dim")
    parser.add_argument("--snapshot", choices=("theta", "phi_delta"),
                        default=Manifest().protocol.snapshot,
                        help="what a NoLoCo snapshot sends (protocol.snapshot; default: the "
                             "manifest's, %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "sync_time.json",
                        help="the results' JSON; the plot goes next to it (.png)")
    parser.add_argument("--resume", action="store_true", help="keep the results in --out, run the rest")
    worker = parser.add_argument_group("worker (internal)")
    worker.add_argument("--method", choices=METHODS)
    worker.add_argument("--index", type=int)
    worker.add_argument("--n", type=int)
    worker.add_argument("--address")
    worker.add_argument("--master")
    worker.add_argument("--peer", action="append", default=[])
    args = parser.parse_args()
    args.params = int(args.params)
    if args.role == "orchestrate":
        orchestrate(args)
    elif args.method == "gloo":
        run_gloo(args)
    elif args.method.startswith("hivemind"):
        run_hivemind(args)
    else:
        from p2p.host import run_event_loop
        run_event_loop(run_ours(args))


if __name__ == "__main__":
    main()
