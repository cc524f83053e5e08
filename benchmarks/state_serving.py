"""Serving memory: how much a member's resident set rises while it answers concurrent state
requests, against one model's state (φ and momentum in fp32, 8 bytes a parameter).

    flock /tmp/lowcomm-heavy.lock .venv/bin/python benchmarks/state_serving.py --model small

Two processes, real p2pd, loopback: a server holding the preset's weights in a NoLoCo outer
state (protocol/noloco.py, whose φ and momentum are read as copies, as the round's
export_state does) serves STATE_KIND requests; a requester with `--requests` hosts downloads
the state from it, all at once. Modes:

    shared   the node's server (node/daemon/state_serving.py): one export a round, byte ranges
             viewing it; each requester downloads with node/rounds/state_fetch.py
    per-request  the server before it: each request exported and encoded the whole state and
             replied with it in one message (its handler, reproduced here)

The server resets its peak (VmHWM, via /proc/self/clear_refs) once it is ready, and reports
the rise of the peak over its resident set then. Writes benchmarks/state_serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "state_serving.json"
MB = 1e6
SWARM, MANIFEST = "bench-state", "bench-state-manifest"


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def model_weights(preset: str):
    import torch

    from node.config.manifest import load_manifest
    from node.train.model import build_model
    m = load_manifest(ROOT / "configs/swarms/local.toml", {"model": {"preset": preset}})
    torch.manual_seed(0)
    model = build_model(m.model, 256)
    return {n: p.detach() for n, p in model.named_parameters()}


class NoLoCoExport:
    """The round policy's part the server reads: NoLoCo's outer state, copied on export."""

    def __init__(self, weights):
        from protocol.noloco import NoLoCo, NoLoCoHyperParameters
        from protocol.tensors import weights_digest
        self.outer = NoLoCo(weights, NoLoCoHyperParameters())
        self.digest = weights_digest(weights)

    def state_version(self, round_index=None):
        return 0, self.digest

    def export_state(self, round_index=None):
        return 0, {"phi": self.outer.slow_weights, "momentum": self.outer.outer_momentum}, self.digest


def per_request_handler(policy):
    """The state handler before the shared export: a whole export and encoding per request."""
    from node.rounds.state import STATE_KIND, encode_state
    from p2p.messages import OutgoingMessage

    async def respond(header):
        loop = asyncio.get_running_loop()
        state_round, groups, digest = await loop.run_in_executor(None, policy.export_state, None)
        tensors = await loop.run_in_executor(None, encode_state, groups)
        return OutgoingMessage(STATE_KIND, 0, tensors, {"round": 1, "phi_round": state_round, "phi": digest})
    return respond


async def serve(args) -> None:
    """The server process: ready when its address file appears; stops when stdin closes."""
    import gc

    import torch

    from node.daemon.state_serving import StateServer
    from node.rounds.state import STATE_KIND
    from p2p.host import P2PHost
    from p2p.identity import NodeIdentity
    from p2p.streams import Transport
    torch.set_num_threads(1)
    weights = model_weights(args.model)
    params = sum(t.numel() for t in weights.values())
    policy = NoLoCoExport(weights)
    del weights
    identity = NodeIdentity.generate()
    identity.save(os.path.join(args.dir, "server.key"))
    host = await P2PHost.start(identity)
    transport = Transport(host.p2p, host.identity, swarm=SWARM, manifest=MANIFEST)
    server = StateServer(policy) if args.mode == "shared" else None
    respond = server.respond if server else per_request_handler(policy)
    transport.on_request(STATE_KIND, respond, accept_round=lambda _r: True)
    await transport.start()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    ready_kb = status_kb("VmRSS")
    Path(args.dir, "server.addr").write_text("\n".join(await host.maddrs()))
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the requester is done
    result = {"params": params, "state_bytes": 8 * params, "ready_rss_mb": ready_kb * 1e3 / MB,
              "peak_rss_mb": status_kb("VmHWM") * 1e3 / MB,
              "exports": server.exports_made if server else None}
    Path(args.dir, "server.json").write_text(json.dumps(result))
    await transport.stop()
    await host.shutdown()


async def request_all(args, server_addrs: list[str]) -> dict:
    """`args.requests` hosts download the state at once; bytes and seconds of each."""
    import torch

    from node.rounds.state import STATE_KIND, StateLayout, decode_state
    from node.rounds.state_fetch import fetch_state
    from p2p.host import P2PHost
    from p2p.identity import NodeIdentity
    from p2p.streams import Transport
    torch.set_num_threads(1)
    layout = StateLayout.of(model_weights(args.model))
    server = server_addrs[0].rsplit("/p2p/", 1)[1]
    hosts, transports = [], []
    try:
        for index in range(args.requests):
            identity = NodeIdentity.generate()
            identity.save(os.path.join(args.dir, f"requester{index}.key"))
            hosts.append(await P2PHost.start(identity, initial_peers=server_addrs))
            transports.append(Transport(hosts[-1].p2p, identity, swarm=SWARM, manifest=MANIFEST))
            await transports[-1].start()

        async def one(transport) -> dict:
            started = time.monotonic()
            if args.mode == "shared":
                fetched = await fetch_state(transport, [server], layout)
                digest, size = fetched.digest, fetched.bytes_fetched
            else:
                received = await transport.request(server, STATE_KIND, 0,
                                                   streams=transport.limits.parallel_streams)
                digest, size = decode_state(received)[1], len(received.payload)
                del received
            return {"seconds": round(time.monotonic() - started, 2), "bytes": size, "digest": digest}
        return {"downloads": await asyncio.gather(*(one(t) for t in transports))}
    finally:
        for transport in transports:
            await transport.stop()
        for host in hosts:
            await host.shutdown()


def run_mode(args, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="lowcomm-state-") as scratch:
        server = subprocess.Popen([sys.executable, __file__, "--serve", "--mode", mode, "--model", args.model,
                                   "--dir", scratch], stdin=subprocess.PIPE)
        try:
            addr = Path(scratch, "server.addr")
            while not addr.exists():
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited with {server.returncode}")
                time.sleep(0.2)
            requester = argparse.Namespace(**{**vars(args), "mode": mode, "dir": scratch})
            downloads = asyncio.run(request_all(requester, addr.read_text().split()))
            server.stdin.close()
            server.wait(timeout=120)
            served = json.loads(Path(scratch, "server.json").read_text())
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    rise = served["peak_rss_mb"] - served["ready_rss_mb"]
    return {"mode": mode, **served, "rise_mb": round(rise, 1),
            "rise_over_state": round(rise / (served["state_bytes"] / MB), 2), **downloads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["shared", "per-request"])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "commit": commit, "model": args.model, "requests": args.requests,
               "runs": [run_mode(args, mode) for mode in args.modes]}
    for run in results["runs"]:
        print(f"{run['mode']:>12}: RSS +{run['rise_mb']:.0f} MB serving {args.requests} requests "
              f"({run['rise_over_state']:.2f} states of {run['state_bytes'] / MB:.0f} MB); "
              f"downloads {[d['seconds'] for d in run['downloads']]} s")
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
