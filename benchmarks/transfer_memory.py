"""A `medium` swap and state transfer between two processes on loopback (real p2pd, signed
streams, the limits the manifest gives), with each side's resident memory measured (issue 21).

    nice -n 10 .venv/bin/python benchmarks/transfer_memory.py --model medium

The payloads have exactly the tensor manifests a member of the swarm sends (node/rounds/
message_sizes.py: θ in int8, and the late-join state, φ and momentum in fp32) but hold synthetic
bytes: a `medium` training node does not fit this machine's memory budget, so the transport's
part is measured alone. The asking process ("A") swaps snapshots with the serving one ("B"),
then downloads B's state and decodes it as a joiner does (node/rounds/state.py). B's state is served from untouched (zero) pages, which the kernel does
not count as resident: B's figure for the state is not a member's (a member holds φ and momentum
anyway; sending them in fp32 copies nothing, benchmarks/node_memory.py), A's is the receiver's.
Peaks are VmHWM, reset through /proc/self/clear_refs before each phase. Writes
benchmarks/transfer_memory.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.node_memory import status_kb  # noqa: E402
from p2p.host import P2PHost, run_event_loop  # noqa: E402
from p2p.identity import NodeIdentity, identity_path  # noqa: E402
from p2p.messages import NUMPY_DTYPES, OutgoingMessage, OutgoingTensor  # noqa: E402
from p2p.streams import Transport  # noqa: E402
from node.rounds.state import decode_state  # noqa: E402
from node.rounds.wire_tensors import from_wire  # noqa: E402

OUT = ROOT / "benchmarks" / "transfer_memory.json"
SNAPSHOT, STATE = "noloco.snapshot", "state"
GB = 1e9


def bounds(model: str):
    """The swarm's manifest, its transport limits and its snapshot and state bounds."""
    from node.config.manifest import load_manifest
    from node.rounds.message_sizes import message_bounds, parameter_shapes, transport_limits
    m = load_manifest(ROOT / "configs/swarms/local.toml", {"model": model, "protocol": {"wire_dtype": "int8"}})
    vocab = 256 if model == "tiny" else 32_000
    found = {b.what.split(" (")[0]: b for b in message_bounds(m, parameter_shapes(m, vocab))}
    return m, transport_limits(m, vocab), found["a NoLoCo snapshot"], found["the late-join state"]


def message(kind: str, bound, zeros: bool) -> OutgoingMessage:
    """`bound`'s tensors, filled (a pattern: every page resident) or zero (pages untouched)."""
    tensors = []
    for entry in bound.tensors:  # the member's own tensors: name, dtype and shape
        data = np.zeros(entry.shape, NUMPY_DTYPES[entry.dtype])
        if not zeros:
            data[...] = 7
        tensors.append(OutgoingTensor(entry.name, entry.dtype, entry.shape, data))
    return OutgoingMessage(kind, 0, tensors)


def phase_start() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def phase_peak_gb() -> float:
    return status_kb("VmHWM") * 1024 / GB


def rss_gb() -> float:
    return status_kb("VmRSS") * 1024 / GB


async def side(args) -> None:
    work = tempfile.mkdtemp(prefix=f"lowcomm-transfer-{args.role}-")
    identity = NodeIdentity.load_or_create(identity_path(work))
    m, (wire, limits), snapshot_bound, state_bound = bounds(args.model)
    host = await P2PHost.start(identity, initial_peers=[args.peer] if args.peer else [])
    transport = Transport(host.p2p, identity, swarm=m.swarm.id, manifest=m.digest, wire_limits=wire, limits=limits)
    report: dict = {"role": args.role, "rss_start_gb": round(rss_gb(), 2)}
    try:
        offered = message(SNAPSHOT, snapshot_bound, zeros=False)
        exact = lambda n: n == offered.total_bytes  # noqa: E731  (node/rounds/noloco/exchange.py)
        if args.role == "B":
            async def reply(header):
                return offered

            async def state(header):
                return message(STATE, state_bound, zeros=True)
            transport.on_swap(SNAPSHOT, reply, accept_round=lambda r: True, accept_bytes=exact)
            transport.on_request(STATE, state, accept_round=lambda r: True)
            await transport.start()
            print(json.dumps({"address": (await host.maddrs())[0]}), flush=True)
            phase_start()
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            report["peak_serving_gb"] = round(phase_peak_gb(), 2)
        else:
            await transport.start()
            peer = args.peer.rsplit("/p2p/", 1)[1]
            report["snapshot_bytes"], report["state_bytes"] = offered.total_bytes, state_bound.total_bytes
            phase_start()
            began = time.perf_counter()
            received = await transport.swap(peer, offered, expected_reply_bytes=offered.total_bytes,
                                            accept_bytes=exact)
            report["swap_seconds"] = round(time.perf_counter() - began, 1)
            assert len(received.payload) == offered.total_bytes
            report["peak_swap_gb"] = round(phase_peak_gb(), 2)
            del received, offered
            report["rss_between_gb"] = round(rss_gb(), 2)
            phase_start()
            began = time.perf_counter()
            state = await transport.request(peer, STATE, 0, streams=limits.parallel_streams,
                                            expected_reply_bytes=state_bound.total_bytes)
            report["state_seconds"] = round(time.perf_counter() - began, 1)
            assert len(state.payload) == state_bound.total_bytes
            report["peak_state_gb"] = round(phase_peak_gb(), 2)
            # decoding it as a joiner does: its tensors must be views of the buffer (else this
            # process would hold the state twice, past the budget: checked on one tensor first)
            first = state.tensors[0].name
            view = next(iter(from_wire(state, first, share=True).values()))
            assert view.data_ptr() == np.frombuffer(state.payload, np.uint8).ctypes.data
            phase_start()
            groups, digest = decode_state(state)
            report["peak_decoded_gb"] = round(phase_peak_gb(), 2)
            report["decoded_tensors"] = sum(len(g) for g in groups.values())
            del state, groups, view
        report["refused"] = transport.counters.snapshot()["refused_incoming"]
        print(json.dumps(report), flush=True)
    finally:
        await transport.stop()
        await host.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--role", choices=("A", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        run_event_loop(side(args))
        return
    me = [sys.executable, __file__, "--model", args.model]
    server = subprocess.Popen([*me, "--role", "B"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = json.loads(server.stdout.readline())["address"]
        asker = subprocess.run([*me, "--role", "A", "--peer", address], stdout=subprocess.PIPE, text=True,
                               timeout=1200, check=True)
        a = json.loads(asker.stdout.strip().splitlines()[-1])
        server.stdin.write("done\n")
        server.stdin.flush()
        b = json.loads(server.stdout.readline())
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    OUT.write_text(json.dumps({"command": f"benchmarks/transfer_memory.py --model {args.model}",
                               "model": args.model, "A": a, "B": b}, indent=1) + "\n")
    print(json.dumps({"A": a, "B": b}, indent=1))


if __name__ == "__main__":
    main()
