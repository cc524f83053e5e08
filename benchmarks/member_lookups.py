"""Member-lookup traffic per node per minute: N bare members on loopback, each with the daemon's
real member cache (node/daemon/members.py) over real Membership records on real p2pd + DHT
nodes, no training and no exchanges. Two loads bound what a daemon does: `idle`, nobody waits on
the view (a NoLoCo node between its pairings), and `--demand`, every node asks for a fresh view
twice a second all along (`MemberCache.want_fresh`: a NoLoCo node looking for a partner, a
DiLoCoX node, which asks between every two steps). Code without `want_fresh` looks up at one
cadence under both.

The members run in --procs processes (one event loop each carries N/procs DHT nodes; one loop
for 24 nodes measured its own lag, not the lookups). Counted per node: the cache's DHT lookups
(`dht.get` calls of the member key) and the DHT find RPCs they caused, with the protobuf bytes
of their requests and responses. Also sampled once a second: the share of samples in which a
node's view held every other member (the lookups must still see the swarm).

    .venv/bin/python benchmarks/member_lookups.py --nodes 8 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.config.settings import NodeSettings, NodeTimeouts  # noqa: E402
from node.daemon.members import MemberCache  # noqa: E402
from node.loop import BackgroundTasks  # noqa: E402
from node.rounds.contributions import BanList  # noqa: E402
from p2p.host import P2PHost, dead_sockets_removed, run_event_loop  # noqa: E402
from p2p.identity import NodeIdentity, identity_path  # noqa: E402
from p2p.membership import Membership  # noqa: E402

MANIFEST = "0123456789abcdef0123456789abcdef"
IN_LOOKUP: contextvars.ContextVar[bool] = contextvars.ContextVar("in_lookup", default=False)


@dataclass
class Meter:
    """One node's lookup traffic."""

    lookups: int = 0
    rpcs: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    full_views: int = 0
    samples: int = 0

    def reset(self) -> None:
        self.lookups = self.rpcs = self.sent_bytes = self.received_bytes = 0
        self.full_views = self.samples = 0


class MeteredStub:
    """hivemind's DHT stub with its find RPCs counted while a member lookup runs."""

    def __init__(self, stub, meter: Meter):
        self._stub, self._meter = stub, meter

    def __getattr__(self, name):
        attribute = getattr(self._stub, name)
        if name != "rpc_find":
            return attribute

        async def rpc_find(request, **options):
            response = await attribute(request, **options)
            if IN_LOOKUP.get():
                self._meter.rpcs += 1
                self._meter.sent_bytes += request.ByteSize()
                self._meter.received_bytes += response.ByteSize()
            return response
        return rpc_find


def metered(host: P2PHost, meter: Meter) -> None:
    protocol, get_stub, get = host.dht.protocol, host.dht.protocol.get_stub, host.dht.get
    protocol.get_stub = lambda peer: MeteredStub(get_stub(peer), meter)

    async def lookup(*args, **options):
        meter.lookups += 1
        token = IN_LOOKUP.set(True)
        try:
            return await get(*args, **options)
        finally:
            IN_LOOKUP.reset(token)
    host.dht.get = lookup


async def demand(cache: MemberCache) -> None:
    """Asks for a fresh view twice a second, where the cache offers it (`want_fresh`)."""
    want_fresh = getattr(cache, "want_fresh", None)
    while want_fresh is not None:
        want_fresh()
        await asyncio.sleep(0.5)


async def group(base: Path, count: int, bootstrap: str | None, swarm_size: int, seconds: float,
                demanded: bool) -> list[Meter]:
    hosts, caches, meters, tasks = [], [], [], BackgroundTasks()
    try:
        for index in range(count):
            identity = NodeIdentity.load_or_create(identity_path(base / f"node{index}"))
            peers = [bootstrap] if bootstrap else (await hosts[0].maddrs() if hosts else [])
            hosts.append(await P2PHost.start(identity, initial_peers=peers))
            if index == 0 and bootstrap is None:
                print(json.dumps({"bootstrap": (await hosts[0].maddrs())[0]}), flush=True)
        for host in hosts:
            membership = Membership(host, "bench", protocol="noloco", manifest=MANIFEST,
                                    ttl_s=NodeSettings.member_ttl_s)
            await membership.start()
            idle = getattr(NodeTimeouts(), "member_idle_refresh_s", None)  # absent before it was
            cache = MemberCache(membership, tasks, manifest=MANIFEST, bans=BanList(2, 60.0),
                                refresh_s=NodeTimeouts().member_refresh_s,
                                **({} if idle is None else {"idle_refresh_s": idle}))
            meters.append(Meter())
            metered(host, meters[-1])
            await cache.start()
            caches.append(cache)
        async with asyncio.timeout(120):  # every view full before measuring
            while not all(len(cache.peers()) == swarm_size - 1 for cache in caches):
                await asyncio.sleep(0.5)
        for meter in meters:
            meter.reset()
        demands = [tasks.spawn(demand(cache), "demand") for cache in caches] if demanded else []
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            await asyncio.sleep(1.0)
            for cache, meter in zip(caches, meters):
                meter.samples += 1
                meter.full_views += len(cache.peers()) == swarm_size - 1
        for task in demands:
            task.cancel()
        for cache in caches:
            await cache.stop(1.0)
        return meters
    finally:
        for host in hosts:
            await host.shutdown()


def run_group(args) -> None:
    meters = run_event_loop(group(Path(args.base), args.count, args.bootstrap, args.nodes, args.seconds,
                                  args.demand))
    print(json.dumps({"meters": [asdict(m) for m in meters]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--demand", action="store_true", help="every node wants a fresh view all along")
    parser.add_argument("--group", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.group:
        return run_group(args)
    sizes = [args.nodes // args.procs + (i < args.nodes % args.procs) for i in range(args.procs)]
    script = str(Path(__file__).resolve())
    common = ["--nodes", str(args.nodes), "--seconds", str(args.seconds), *(["--demand"] if args.demand else [])]
    with tempfile.TemporaryDirectory(prefix="lowcomm-lookups-") as scratch, dead_sockets_removed():
        first = subprocess.Popen([sys.executable, script, "--group", "--count", str(sizes[0]),
                                  "--base", f"{scratch}/g0", *common], stdout=subprocess.PIPE, text=True)
        bootstrap = json.loads(first.stdout.readline())["bootstrap"]
        rest = [subprocess.Popen([sys.executable, script, "--group", "--count", str(size), "--bootstrap",
                                  bootstrap, "--base", f"{scratch}/g{i + 1}", *common],
                                 stdout=subprocess.PIPE, text=True) for i, size in enumerate(sizes[1:])]
        meters = []
        for process in [first, *rest]:
            out, _ = process.communicate(timeout=args.seconds + 600)
            meters += [Meter(**m) for m in json.loads(out.strip().splitlines()[-1])["meters"]]
    minutes = args.seconds / 60
    per_node = {field: sum(getattr(m, field) for m in meters) / len(meters) / minutes
                for field in ("lookups", "rpcs", "sent_bytes", "received_bytes")}
    full = sum(m.full_views for m in meters) / max(1, sum(m.samples for m in meters))
    print(json.dumps({"nodes": args.nodes, "seconds": args.seconds, "demand": args.demand,
                      "refresh_s": NodeTimeouts().member_refresh_s, "per_node_per_minute": per_node,
                      "full_view_share": round(full, 4)}))


if __name__ == "__main__":
    main()
