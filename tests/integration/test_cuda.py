"""The CUDA path, as a volunteer with a GPU runs it: resume after SIGKILL, two daemons exchanging,
the status view's GPU fields, a snapshot decoded and φ digested on the GPU as on the host. Skipped where torch sees no CUDA device (CI has none); run on a GPU
machine with `python -m pytest -q tests/integration/test_cuda.py`.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tests.integration.test_train_cli import SMALL, run_cli, step_losses, wait_for
from tests.swarm_harness import SwarmHarness, left, small_manifest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]
CUDA = ["--set", "train.device=cuda", "--set", "train.checkpoint_every=10"]


def test_sigkill_then_resume_on_cuda_matches_an_uninterrupted_run(tmp_path):
    """The CUDA RNG, fused AdamW's state and the bf16 model come back from the checkpoint.
    Two uninterrupted runs give the spread CUDA's own kernels allow between identical runs; the
    resumed run must stay within it (bitwise equal where those two are)."""
    runs = {name: tmp_path / name for name in ("straight", "again", "killed")}
    done = run_cli("train", "--data-dir", str(runs["straight"]), *SMALL, *CUDA)
    assert done.returncode == 0, done.stderr
    started = [json.loads(line) for line in (runs["straight"] / "metrics.jsonl").open()]
    assert started[0]["event"] == "start" and started[0]["device"].startswith("cuda"), started[0]
    for name in ("again", "killed"):  # the same node: same identity key, same batches
        runs[name].mkdir()
        for key in runs["straight"].glob("identity*"):
            shutil.copy2(key, runs[name] / key.name)
    again = run_cli("train", "--data-dir", str(runs["again"]), *SMALL, *CUDA)
    assert again.returncode == 0, again.stderr
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "train", "--data-dir",
                             str(runs["killed"]), *SMALL, *CUDA],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (runs["killed"] / "checkpoints" / "ckpt-0000000020.pt").exists()
                 or proc.poll() is not None, 120, "the step-20 checkpoint")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = run_cli("train", "--data-dir", str(runs["killed"]), *SMALL, *CUDA)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from ckpt-00000000" in resumed.stdout
    straight, again, killed = (step_losses(runs[n]) for n in ("straight", "again", "killed"))
    assert sorted(killed) == list(range(1, 41))
    spread = max(abs(straight[s] - again[s]) for s in range(1, 41))
    gap = max(abs(straight[s] - killed[s]) for s in range(1, 41))
    print(f"\nCUDA resume: largest loss difference, resumed against uninterrupted {gap:.3g}; "
          f"between two uninterrupted runs {spread:.3g}")
    if spread == 0:
        assert [killed[s] for s in range(1, 41)] == [straight[s] for s in range(1, 41)]
    else:  # kernels that are not deterministic (atomics): the resumed run stays within twice
        assert gap <= 2 * spread, (gap, spread)


def gpu_manifest(swarm: str, protocol: str):
    m = small_manifest(swarm, protocol)
    # a GPU runs this model's steps in milliseconds: paced to the CPU rounds' seconds, so that
    # pairs form and messages land within a round as on the CPU
    m.train.device, m.train.min_step_seconds = "cuda", 0.1
    return m


@pytest.mark.parametrize("protocol", ["noloco", "dilocox"])
def test_two_daemons_exchange_on_cuda_and_show_the_gpu(harness_factory, protocol):
    harness: SwarmHarness = harness_factory(gpu_manifest(f"t-cuda-{protocol}", protocol))
    nodes = harness.start(2)
    if protocol == "noloco":
        def exchanged(events):
            return sum(e["event"] == "round" and e.get("partner") is not None for e in events) >= 3
    else:
        def exchanged(events):
            return sum(e["event"] == "round" and len(e.get("group") or []) == 2 for e in events) >= 3
    for node in nodes:
        node.wait_for(exchanged, 120, "three rounds with the other node's contribution")
    shown = subprocess.run([sys.executable, "-m", "node.cli", "status", "--data-dir",
                            str(nodes[0].data_dir), "--json", "--once"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    print(f"\nstatus of a CUDA node: device {status.get('device')}, "
          f"{status.get('device_name')}, memory {status.get('device_memory_bytes')} of "
          f"{status.get('device_memory_total_bytes')} bytes, util {status.get('device_util_percent')}%")
    assert status["device"].startswith("cuda")
    assert status["device_name"] and status["device_memory_bytes"] > 0
    assert status["device_memory_total_bytes"] > status["device_memory_bytes"]
    if protocol == "dilocox":  # the agreed state is bitwise one across the two GPUs' nodes
        digests = [{r["round"]: r["phi_digest"] for r in n.events("round")} for n in nodes]
        common = sorted(set(digests[0]) & set(digests[1]))
        assert common and all(digests[0][r] == digests[1][r] for r in common[-2:]), digests


def test_a_lone_daemon_killed_on_cuda_resumes_with_the_losses_of_an_uninterrupted_run(
        harness_factory):
    """The daemon's own state on the GPU (θ, AdamW, NoLoCo's φ and δ beside θ) comes back from a
    checkpoint written in host memory. Alone, a node's rounds are local updates: deterministic."""
    m = gpu_manifest("t-cuda-resume", "noloco")
    m.train.steps, m.train.checkpoint_every, m.train.min_step_seconds = 60, 20, 0.05
    harness: SwarmHarness = harness_factory(m)
    straight = harness.start_node(0, extra=["--min-peers", "0"])
    straight.wait_for(left, 120, "the last step")
    killed_dir = harness.base / "killed"
    killed_dir.mkdir()
    for key in straight.data_dir.glob("identity*"):
        shutil.copy2(key, killed_dir / key.name)
    killed = harness.start_node(1, extra=["--min-peers", "0"], data_dir=killed_dir)
    killed.wait_for(lambda ev: any(e["event"] == "checkpoint" and e["step"] == 20 for e in ev),
                    120, "the step-20 checkpoint")
    harness.kill(killed)
    assert not left(killed.events()), "the run finished before it could be killed"
    resumed = harness.start_node(1, extra=["--min-peers", "0"], data_dir=killed_dir)
    events = resumed.wait_for(left, 120, "the last step after resuming")
    assert any(e["event"] == "resumed" for e in events)
    expected, got = step_losses(straight.data_dir), step_losses(killed_dir)
    assert sorted(got) == sorted(expected) == list(range(1, 61))
    gap = max(abs(expected[s] - got[s]) for s in expected)
    print(f"\nCUDA daemon resume: largest loss difference against the uninterrupted run {gap:.3g}")
    assert gap == 0, [(s, expected[s], got[s]) for s in expected if expected[s] != got[s]][:5]


@pytest.mark.parametrize("wire_dtype", ["int8", "int4", "bf16"])
def test_a_snapshot_decoded_on_the_gpu_equals_the_hosts_and_so_does_the_digest(wire_dtype):
    """A partner's snapshot is decoded where φ lies (node/rounds/noloco/round.py), and φ's digest
    stages GPU bytes through pinned buffers (protocol/tensors.py): both must give, bitwise, what
    the host gives, or a GPU node would apply other numbers or publish another digest."""
    from node.rounds.noloco.payload import decode_snapshot, encode_snapshot
    from node.simulator.exchange import InMemoryMessage
    from protocol.noloco import NoLoCoSnapshot
    from protocol.tensors import HostStaging, weights_digest

    generator = torch.Generator().manual_seed(1)
    shapes = {"w": (3000, 77), "b": (77,), "odd": (5, 13)}  # 77 and 65: blocks cut short
    theta = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    phi = {name: torch.zeros(shape) for name, shape in shapes.items()}
    sent = encode_snapshot(NoLoCoSnapshot(phi, theta), wire_dtype, "theta")
    host = decode_snapshot(InMemoryMessage(0, sent), "theta", "peer", wire_dtype, shapes)["theta"]
    gpu = decode_snapshot(InMemoryMessage(0, sent), "theta", "peer", wire_dtype, shapes,
                          torch.device("cuda"))["theta"]
    for name in shapes:
        assert gpu[name].device.type == "cuda"
        assert torch.equal(gpu[name].cpu(), host[name]), name
    big = {"embed": torch.randn(3 * HostStaging.piece_bytes // 4 + 5, generator=generator), **theta}
    assert weights_digest({k: v.cuda() for k, v in big.items()}) == weights_digest(big)
