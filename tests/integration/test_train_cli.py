"""`lowcomm-node train` as a user runs it: a real process, killed and resumed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SMALL = ["--set", "model.dim=64", "--set", "model.n_heads=4", "--set", "model.n_layers=2",
         "--set", "model.ffn_hidden=128", "--set", "data.seq_len=32",
         "--set", "train.micro_batch_size=4", "--set", "train.tokens_per_step=256",
         "--set", "train.warmup_steps=5", "--set", "train.eval_every=0",
         "--set", "train.eval_batches=2", "--set", "train.threads=1", "--set", "train.steps=40"]
CLI = [sys.executable, "-m", "node.cli"]


def run_cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def step_losses(data_dir: Path) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs the replayed steps again)."""
    losses = {}
    for line in (data_dir / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "step":
            losses[event["step"]] = event["loss"]
    return losses


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = run_cli("train", "--data-dir", str(straight), *SMALL,
                   "--set", "train.checkpoint_every=10")
    assert done.returncode == 0, done.stderr
    # the same node (same identity key) run again, killed with SIGKILL after its 2nd checkpoint
    killed.mkdir()
    for key in straight.glob("identity*"):
        shutil.copy2(key, killed / key.name)
    proc = subprocess.Popen([*CLI, "train", "--data-dir", str(killed), *SMALL,
                             "--set", "train.checkpoint_every=10"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (killed / "checkpoints" / "ckpt-0000000020.pt").exists()
                 or proc.poll() is not None, 60, "the step-20 checkpoint")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = run_cli("train", "--data-dir", str(killed), *SMALL,
                      "--set", "train.checkpoint_every=10")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from ckpt-00000000" in resumed.stdout
    expected, got = step_losses(straight), step_losses(killed)
    assert sorted(got) == list(range(1, 41))
    assert [got[s] for s in range(1, 41)] == [expected[s] for s in range(1, 41)]


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    proc = subprocess.Popen([*CLI, "train", "--data-dir", str(tmp_path), *SMALL,
                             "--set", "train.steps=100000", "--set", "train.checkpoint_every=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "metrics.jsonl").exists()
                 and '"step"' in (tmp_path / "metrics.jsonl").read_text(), 60, "a first step")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "SIGTERM received" in out
    assert list((tmp_path / "checkpoints").glob("ckpt-*.pt"))


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_used(tmp_path):
    first = run_cli("train", "--data-dir", str(tmp_path), *SMALL, "--set", "train.steps=20",
                    "--set", "train.checkpoint_every=10")
    assert first.returncode == 0, first.stderr
    newest = tmp_path / "checkpoints" / "ckpt-0000000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    again = run_cli("train", "--data-dir", str(tmp_path), *SMALL, "--set", "train.steps=20")
    assert again.returncode == 0, again.stderr
    assert "checkpoint ckpt-0000000020.pt is corrupt (checksum mismatch); using the previous" \
        in again.stdout
    assert "resumed from ckpt-0000000010.pt" in again.stdout


@pytest.mark.parametrize("command", [[], ["train"], ["config"]])
def test_help_is_there_for_every_command(command):
    result = run_cli(*command, "--help", timeout=60)
    assert result.returncode == 0 and "usage: lowcomm-node" in result.stdout
    assert len(result.stdout) > 300


def test_bad_config_fails_before_anything_starts(tmp_path):
    result = run_cli("train", "--data-dir", str(tmp_path), "--set", "train.steps=-3")
    assert result.returncode == 2
    assert result.stderr.strip() == ("lowcomm-node: config error: config key 'train.steps' = -3 "
                                     "is out of range: it must be >= 1 and <= 1099511627776")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_checkpoint_of_another_model_is_refused(tmp_path):
    assert run_cli("train", "--data-dir", str(tmp_path), *SMALL, "--set",
                   "train.steps=2").returncode == 0
    other = run_cli("train", "--data-dir", str(tmp_path), *SMALL, "--set", "model.dim=96",
                    "--set", "model.n_heads=4")
    assert other.returncode == 1
    assert "was trained with model.dim = 64, this config says 96" in other.stderr


def test_bad_announce_address_is_named_before_anything_starts(tmp_path):
    result = run_cli("join", "--swarm", "local", "--data-dir", str(tmp_path),
                     "--announce", "10.0.0.1:4100")
    assert result.returncode == 2
    assert result.stderr.strip() == ("lowcomm-node: config error: --announce '10.0.0.1:4100' is "
                                     "not a multiaddr: write it like /ip4/203.0.113.7/tcp/31337")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
