"""`lowcomm-node simulate` as a user runs it: a real process writing JSON, a plot and a table."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

VERY_SMALL = ["--set", "model.dim=32", "--set", "model.n_heads=2", "--set", "model.n_layers=1",
              "--set", "model.ffn_hidden=64", "--set", "data.seq_len=32",
              "--set", "train.micro_batch_size=4", "--set", "train.tokens_per_step=128",
              "--set", "train.warmup_steps=2", "--set", "train.eval_batches=2"]
CLI = [sys.executable, "-m", "node.cli", "simulate"]


def run_cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_simulate_writes_metrics_plot_and_table(tmp_path):
    done = run_cli("--protocol", "noloco", "--workers", "3", "-H", "4", "--steps", "12",
                   "--timing", "blocking", "--threads", "1", "--out", str(tmp_path), *VERY_SMALL)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["method"] == "NoLoCo H=4 blocking" and metrics["settings"]["workers"] == 3
    rounds = metrics["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert [r["tokens_per_replica"] for r in rounds] == [512, 1024, 1536]
    assert all(r["val_loss_min"] <= r["val_loss_mean"] <= r["val_loss_max"] for r in rounds)
    assert rounds[-1]["bytes_sent_per_replica"] > 0 and rounds[-1]["weight_spread"] > 0
    assert all(len(r["pairs"]) == 1 for r in rounds)  # three replicas: one pair, one alone
    assert (tmp_path / "validation_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "val loss" in done.stdout and "wrote" in done.stdout


def test_simulate_refuses_a_flag_of_another_protocol_in_one_sentence(tmp_path):
    done = run_cli("--protocol", "diloco", "--codec", "lowrank", "--out", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.strip() == ("lowcomm-node: error: --codec does not apply to diloco: "
                                   "it is for dilocox.")
    assert not (tmp_path / "metrics.json").exists()
