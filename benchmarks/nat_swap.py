"""Swap time and throughput between homes behind NAT (forwarded, or through a punched hole)
against direct links, at the same shaped rate.

    sudo .venv/bin/python benchmarks/nat_swap.py --rate 50mbit --size-mb 16 --repeats 3 --publics 5

The testbed (benchmarks/nat_testbed.py): `--publics` public namespaces (at least three) and two
homes behind NAT routers; tbf limits every access link (each public host's and each router's WAN
port, both ways) to --rate. pub0 is the bootstrap peer, the relay and the forwarding member; the
homes bootstrap from every public peer; all are peers with our real P2PHost (reachability found by
the dial-back check) and signed Transport. Measured paths, one after the other, each timed
`repeats` times after a warm-up:

  public-public       pub1 -> pub2, a direct connection
  home-public         home0 -> pub2, direct: the home dials out through its NAT
  home-home           home0 -> home1: forwarded by pub0 (the homes cannot dial each other, and
                      the circuit relay they reach each other through may cut a connection after
                      128 KiB: p2p/forwarding.py)
  home-home, punched  (with --publics 4 or more) the same after 20 s, in which four public peers
                      observed each home's address, a fresh relayed connection let DCUtR punch a
                      hole, and the transport's recheck (0.5 s here, a minute in the daemon) found
                      the direct connection

per path: `push` (one direction) and `swap` (both halves at once, as a NoLoCo swap). A forwarded
byte crosses the forwarder's access link twice (in, then out), and in a swap both halves share
it. The JSON with every timing lands beside NOTEBOOK.md (benchmarks/nat_swap.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.nat_testbed import NatTestbed  # noqa: E402

SWARM = "bench-nat"
PATHS = {"public-public": ("pub1", "pub2"), "home-public": ("home0", "pub2"), "home-home": ("home0", "home1")}


# ---------------------------------------------------------------------------- one peer
async def run_peer(args) -> None:
    from hivemind.p2p import PeerID

    from p2p.host import P2PHost
    from p2p.identity import NodeIdentity, identity_path
    from p2p.messages import OutgoingMessage
    from p2p.paths import RelayLimits
    from p2p.streams import Transport

    work = tempfile.mkdtemp(prefix="lowcomm-natbench-")
    host = await P2PHost.start(NodeIdentity.load_or_create(identity_path(work)), host_maddrs=[args.listen],
                               initial_peers=[p for p in args.peer.split(",") if p])
    payload = np.random.default_rng(0).integers(0, 256, args.size_mb * 10**6, dtype=np.uint8)

    def message():  # a new message per transfer: a reused one would skip hashing
        return OutgoingMessage.from_arrays("bench", 0, {"payload": payload})

    async def reply(header):
        return message()

    async def deliver(received):
        pass
    transport = Transport(host.p2p, host.identity, swarm=SWARM, manifest=SWARM)
    transport.forwarder.enabled = not args.no_forward
    transport.forward_recheck_s = args.recheck_s
    if args.relay_limit_mb:  # what a relay would cut, scaled down (tests/integration/test_nat.py)
        transport.relay_limits = RelayLimits(max_bytes=args.relay_limit_mb * 10**6)
    transport.on_swap("bench", reply, accept_round=lambda r: True)
    transport.on_push("bench", deliver, accept_round=lambda r: True)
    await transport.start()
    try:
        print(json.dumps({"peer_id": host.peer_id.to_base58(), "addrs": await host.maddrs(),
                          "reachability": host.reachability.line()}), flush=True)
        if not args.target:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
            return
        target = PeerID.from_base58(args.target)
        small = OutgoingMessage.from_arrays("bench", 0, {"payload": payload[:1 << 16]})
        if args.relay_limit_mb:
            said = await _refusals(transport, target, message(), small)
            # redialling a member by its relayed address (the daemon's Reconnector does it), after
            # closing every connection to it (a dial to a connected peer would prove nothing)
            await host.p2p._client.disconnect(target)
            said["connected_before_redial"] = target in {p.peer_id for p in await host.p2p.list_peers()}
            said["redialled"] = await host.reconnect([a for a in args.redial.split(",") if a])
            print(json.dumps(said), flush=True)
            return
        await transport.swap(target, small)  # connect before timing
        if args.settle_s:  # the homes learn their public address; then a fresh relayed connection,
            await asyncio.sleep(args.settle_s)  # on which DCUtR punches, and the hole at the recheck
            await transport.swap(target, small)
            await asyncio.sleep(2 * args.recheck_s)
        times: dict[str, list[float]] = {"push": [], "swap": []}
        for _ in range(args.repeats):
            for mode in times:
                start = time.perf_counter()
                if mode == "push":
                    await transport.push(target, message())
                else:
                    await transport.swap(target, message())
                times[mode].append(time.perf_counter() - start)
        paths = transport.counters.paths
        print(json.dumps({"times": times, "bytes": payload.nbytes,
                          "streams_relayed": paths.relayed_by_peer.get(args.target, 0),
                          "streams_forwarded": paths.forwarded_by_peer.get(args.target, 0),
                          "streams_direct": paths.direct_by_peer.get(args.target, 0)}), flush=True)
    finally:
        await transport.stop()
        await host.shutdown()
        shutil.rmtree(work, ignore_errors=True)


async def _refusals(transport, target, large, small) -> dict:
    """What the sender and the replier say when a transfer over a relay exceeds its limit."""
    from p2p.errors import P2PError
    said = {}
    for name, call in (("push", transport.push(target, large)),
                       ("reply", transport.swap(target, small))):
        try:
            await call
            said[name] = None
        except P2PError as error:
            said[name] = f"{type(error).__name__}: {error}"
    said["streams_relayed"] = transport.counters.paths.relayed_by_peer.get(target.to_base58(), 0)
    return said


# ---------------------------------------------------------------------------- the run
def start_peer(net: NatTestbed, where: str, args, peer: str = "", target: str = "",
           extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
    index = int(where[-1])
    if where.startswith("pub"):
        namespace, port = net.public(index), 4001 if index == 0 else 0
        listen = f"/ip4/{net.public_address(index)}/tcp/{port}"
    else:
        namespace, listen = net.home(index), "/ip4/0.0.0.0/tcp/0"
    argv = [sys.executable, str(Path(__file__).resolve()), "peer", "--listen", listen, "--size-mb",
            str(args.size_mb), "--repeats", str(args.repeats), "--peer", peer, "--target", target, *extra]
    process = net.popen(namespace, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"the peer in {where} did not start (exit {process.wait()})")
    return process, json.loads(line)


def stop_peers(processes: list[subprocess.Popen]) -> None:
    """Servers leave when their stdin closes (their p2pd and sockets with them); killed, they
    would leave hivemind's client sockets in /tmp."""
    for process in processes:
        process.stdin.close()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(args) -> dict:
    results = {}
    with NatTestbed(publics=max(3, args.publics), homes=2, rate=args.rate) as net:
        serving = [start_peer(net, "pub0", args)]
        bootstrap = serving[0][1]["addrs"][0]
        # the homes bootstrap from every public peer: DCUtR punches only from an address that four
        # of them observed (with --publics 4 or more; p2p/reachability.py)
        serving += [start_peer(net, f"pub{i}", args, peer=bootstrap) for i in range(3, args.publics)]
        observers = [info["addrs"][0] for _, info in serving]
        peers = {name: ",".join(observers) if name.startswith("home") else bootstrap
                 for name in ("pub1", "pub2", "home0", "home1")}
        servers = {}
        for name in ("pub2", "home1"):
            serving.append(start_peer(net, name, args, peer=peers[name]))
            servers[name] = serving[-1][1]
        paths = dict(PATHS)
        if args.publics >= 4:
            paths["home-home, punched"] = ("home0", "home1")
        for path, (client, server) in paths.items():
            # once punched, the hole is tried at the next recheck: at once here, after settling
            punch = ("--settle-s", "20", "--recheck-s", "0.5") if "punched" in path else ()
            process, started = start_peer(net, client, args, peer=peers[client], target=servers[server]["peer_id"],
                                          extra=punch)
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"path {path}: the client failed (exit {process.wait()})")
            measured = json.loads(line)
            process.wait(timeout=60)
            medians = {mode: statistics.median(values) for mode, values in measured["times"].items()}
            results[path] = {
                "client": started["reachability"], "server": servers[server]["reachability"],
                "streams_relayed": measured["streams_relayed"], "streams_direct": measured["streams_direct"],
                "streams_forwarded": measured["streams_forwarded"],
                "median_s": medians, "times_s": measured["times"],
                "mbit_per_s_per_direction": {mode: 8 * measured["bytes"] / 1e6 / s for mode, s in medians.items()},
            }
            print(f"{path:14} push {medians['push']:6.2f} s  swap {medians['swap']:6.2f} s  "
                  f"relayed streams {measured['streams_relayed']}, forwarded {measured['streams_forwarded']}, "
                  f"direct {measured['streams_direct']}", flush=True)
        stop_peers([process for process, _ in serving])
    return results


def report(results: dict, args, command: str) -> str:
    lines = [f"`{command}` (every access link {args.rate} both ways, {args.size_mb} MB payload, median of "
             f"{args.repeats}):", "",
             "| path | connection | push s | push Mbit/s | swap s | swap Mbit/s per direction | swap vs public-public |",
             "|---|---|---|---|---|---|---|"]
    base = results["public-public"]["median_s"]["swap"]
    for path, r in results.items():
        how = ("forwarded by pub0" if r.get("streams_forwarded") and not r["streams_direct"] else
               "relayed" if r["streams_relayed"] and not r["streams_direct"] else
               "direct, a punched hole" if "punched" in path else "direct")
        rate = r["mbit_per_s_per_direction"]
        lines.append(f"| {path} | {how} | {r['median_s']['push']:.2f} | {rate['push']:.1f} | "
                     f"{r['median_s']['swap']:.2f} | {rate['swap']:.1f} | {r['median_s']['swap'] / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=["run", "peer"])
    parser.add_argument("--rate", default="50mbit")
    parser.add_argument("--size-mb", type=int, default=16)
    parser.add_argument("--publics", type=int, default=3, help="public peers (4 or more: a punched path too)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "nat_swap.json")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")  # peer: where it listens
    parser.add_argument("--peer", default="")      # peer: the bootstrap peers, comma-separated
    parser.add_argument("--target", default="")    # peer: measure against this peer id
    parser.add_argument("--redial", default="")    # peer: with --relay-limit-mb, redial these addresses
    parser.add_argument("--settle-s", type=float, default=0.0)  # peer: wait after connecting
    parser.add_argument("--relay-limit-mb", type=int, default=0)  # peer: refuse relayed transfers above this
    parser.add_argument("--no-forward", action="store_true")  # peer: forward no stream for others
    parser.add_argument("--recheck-s", type=float, default=60.0)  # peer: forwarded peers tried directly again
    args = parser.parse_args()
    if args.command == "peer":
        from p2p.host import run_event_loop
        run_event_loop(run_peer(args))
        return
    command = "sudo .venv/bin/python benchmarks/nat_swap.py " + " ".join(sys.argv[1:])
    results = run(args)
    args.json.write_text(json.dumps({"command": command, "rate": args.rate, "size_mb": args.size_mb,
                                     "repeats": args.repeats, "results": results}, indent=2) + "\n")
    print(report(results, args, command))


if __name__ == "__main__":
    main()
