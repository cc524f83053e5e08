"""A state holder or a state downloader in its own process (and network namespace), for
tests/integration/test_state_transfer.py: real p2pd, the node's own StateServer and fetch_state.

    python tests/state_peer.py hold  --listen IP --out DIR --name victim --params N
    python tests/state_peer.py fetch --listen IP --out DIR --holders ADDR... --params N
                                     [--kill-pid PID --kill-at FRACTION] [--min-rate B/S]

`hold` serves a state of N parameters (φ seeded: every holder of the same N serves the same
digest), writes DIR/<name>.addr once it listens, and serves until killed or its stdin closes.
`fetch` downloads the state from the holders in order and writes DIR/fetch.json: the digest,
the bytes fetched (fetch_state's count, and every byte the transport read), the sources and the
seconds; with --kill-pid it SIGKILLs that process group once the bytes read pass FRACTION of the state
(the holder serving it, mid-transfer). With --whole-bound S it downloads as the node did before
ranges, to see the tests fail on it: each holder in turn asked for the whole state in one
message (a state of at most one range), bounded by S seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.daemon.state_serving import StateServer  # noqa: E402
from node.rounds.state import STATE_KIND, StateLayout  # noqa: E402
from node.rounds.state_fetch import FetchedState, fetch_state  # noqa: E402
from p2p.errors import P2PError  # noqa: E402
from p2p.host import P2PHost  # noqa: E402
from p2p.limits import TransferLimits  # noqa: E402
from p2p.progress import NeedBy  # noqa: E402
from p2p.identity import NodeIdentity  # noqa: E402
from p2p.reachability import ReachabilityOptions  # noqa: E402
from p2p.streams import Transport  # noqa: E402
from protocol.tensors import weights_digest  # noqa: E402

SWARM, MANIFEST = "t-state-transfer", "t-state-transfer-manifest"
STATE_ROUND = 7


def state_phi(params: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(params // 2, generator=g), "b": torch.randn(params - params // 2, generator=g)}


class FixedState:
    """A round policy's export, fixed (the state server asks only these two); `state`:
    (round, {"phi": ..., "momentum": ...}, the digest it names)."""

    def __init__(self, state: tuple[int, dict, str] = (-1, {}, "")):
        self.state = state

    def export_state(self, round_index=None):
        return self.state

    def state_version(self, round_index=None):
        return self.state[0], self.state[2]


def held(params: int) -> FixedState:
    """The state every holder of `params` parameters serves: φ and a momentum of a tenth of it."""
    phi = state_phi(params)
    return FixedState((STATE_ROUND, {"phi": phi, "momentum": {n: t / 10 for n, t in phi.items()}},
                       weights_digest(phi)))


async def start(args, name: str, peers: list[str]) -> tuple[P2PHost, Transport]:
    identity = NodeIdentity.generate()
    identity.save(os.path.join(args.out, f"{name}.key"))
    host = await P2PHost.start(identity, host_maddrs=[f"/ip4/{args.listen}/tcp/0"], initial_peers=peers,
                               reachability=ReachabilityOptions(mode="public"))
    limits = TransferLimits(min_rate_bytes_per_s=args.min_rate, stall_s=args.stall_s)
    transport = Transport(host.p2p, identity, swarm=SWARM, manifest=MANIFEST, limits=limits)
    return host, transport


async def hold(args) -> None:
    host, transport = await start(args, args.name, [])
    server = StateServer(held(args.params))
    server.register(transport)
    await transport.start()
    addr = Path(args.out, f"{args.name}.addr")
    addr.with_suffix(".tmp").write_text("\n".join(await host.maddrs()))
    addr.with_suffix(".tmp").rename(addr)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await transport.stop()
        await host.shutdown()


async def fetch(args) -> None:
    host, transport = await start(args, "fetcher", args.holders)
    layout = StateLayout.of(state_phi(args.params))
    holders = [a.rsplit("/p2p/", 1)[1] for a in args.holders]
    killed_at = None

    async def kill_mid_transfer() -> None:
        nonlocal killed_at
        while transport.counters.bytes_received < args.kill_at * layout.total:
            await asyncio.sleep(0.005)
        os.killpg(args.kill_pid, signal.SIGKILL)  # the holder and its p2pd
        killed_at = transport.counters.bytes_received
    await transport.start()
    killer = asyncio.ensure_future(kill_mid_transfer()) if args.kill_pid else None
    started = time.monotonic()
    try:
        fetched = await (whole_state(transport, holders, layout, args.whole_bound) if args.whole_bound
                         else fetch_state(transport, holders, layout))
        result = {"digest": fetched.digest, "expected": weights_digest(state_phi(args.params)),
                  "total": layout.total, "bytes_fetched": fetched.bytes_fetched,
                  "bytes_read": transport.counters.bytes_received, "killed_at": killed_at,
                  "sources": [holders.index(s) for s in fetched.sources],
                  "seconds": time.monotonic() - started}
    except Exception as exc:  # the test reads the sentence
        result = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                  "killed_at": killed_at}
    finally:
        if killer is not None:
            killer.cancel()
        await transport.stop()
        await host.shutdown()
    Path(args.out, "fetch.json").write_text(json.dumps(result))


async def whole_state(transport, holders: list[str], layout: StateLayout, bound_s: float) -> FetchedState:
    """The download before ranges: the whole state from one holder, else the next, each in one
    message with a fixed bound; what broke off is fetched again from the start."""
    asked, errors = 0, []
    for holder in holders:
        asked += layout.total
        try:
            received = await transport.request(holder, STATE_KIND, 0, need_by=NeedBy(bound_s),
                                               streams=transport.limits.parallel_streams)
        except P2PError as exc:
            errors.append(str(exc))
            continue
        buffer = torch.frombuffer(bytearray(received.payload), dtype=torch.uint8)
        groups, digest = layout.decode(buffer)
        return FetchedState(groups, digest, dict(received.meta), [(holder, 0, layout.total)], asked)
    raise RuntimeError("; ".join(errors))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["hold", "fetch"])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="holder")
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--holders", nargs="*", default=[])
    parser.add_argument("--kill-pid", type=int, default=0)
    parser.add_argument("--kill-at", type=float, default=0.4)
    parser.add_argument("--min-rate", type=float, default=TransferLimits().min_rate_bytes_per_s)
    parser.add_argument("--whole-bound", type=float, default=0.0)
    parser.add_argument("--stall-s", type=float, default=TransferLimits().stall_s)
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.run(hold(args) if args.role == "hold" else fetch(args))


if __name__ == "__main__":
    main()
