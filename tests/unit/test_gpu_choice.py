"""One daemon per GPU: `join --gpu N`, `local-swarm --gpus 0,1,...` (node/cli.py,
node/ops/local_swarm.py), their plumbing to each node's train.device and their refusals."""

import pytest
import torch

from node.cli import _gpu_overrides, main
from node.config.manifest import find_manifest, load_manifest
from node.config.schema import nest_overrides, parse_override
from node.ops.local_swarm import gpu_arguments, join_command

GPUS_HERE = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def fake_four_gpus(monkeypatch):
    """A fake of a machine with four GPUs, for the plumbing alone (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_join_refuses_a_gpu_this_machine_lacks_in_one_sentence(capsys, tmp_path):
    code = main(["join", "--swarm", "local", "--gpu", str(GPUS_HERE), "--data-dir", str(tmp_path / "n")])
    err = capsys.readouterr().err
    assert code == 2  # a usage error, refused before anything starts
    has = f"has {GPUS_HERE} (0-{GPUS_HERE - 1})" if GPUS_HERE else "has none that torch can use"
    assert err == (f"lowcomm-node: config error: --gpu {GPUS_HERE} names GPU {GPUS_HERE}, which this "
                   f"machine does not have: it {has}\n")
    assert not (tmp_path / "n").exists()  # refused before the daemon made anything


def test_local_swarm_refuses_before_starting_any_node(capsys, tmp_path):
    base = tmp_path / "swarm"
    cases = {("--gpus", f"0,{GPUS_HERE}"): f"--gpus 0,{GPUS_HERE} names GPU",
             ("--gpus", "0,0"): "--gpus '0,0' names a GPU twice: each node gets its own",
             ("--gpus", "0,x"): "--gpus '0,x' is not a list of GPU indices",
             ("--gpus", "0,1", "--nodes", "3"): "--nodes 3 and --gpus 0,1 differ"}
    for arguments, message in cases.items():
        assert main(["local-swarm", "--swarm", "local", "--base-dir", str(base), *arguments]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not base.exists()


def test_each_node_of_a_local_swarm_is_started_on_its_own_gpu(fake_four_gpus, tmp_path):
    node_args = gpu_arguments("2,0,3", None)
    assert node_args == [["--gpu", "2"], ["--gpu", "0"], ["--gpu", "3"]]
    commands = [join_command(tmp_path / f"node-{i}", ["--swarm", "local", *own], [])
                for i, own in enumerate(node_args)]
    assert [c[c.index("--gpu") + 1] for c in commands] == ["2", "0", "3"]
    assert gpu_arguments(None, None) == [[], [], []] and gpu_arguments(None, 2) == [[], []]
    with pytest.raises(ValueError, match="--gpus 0,4 names GPU 4, which this machine does not have: it has 4"):
        gpu_arguments("0,4", None)


def test_gpu_n_is_train_device_cuda_n_and_stays_out_of_the_digest(fake_four_gpus):
    overrides = _gpu_overrides(3, [])
    assert overrides == ['train.device="cuda:3"']
    path = find_manifest("local")
    chosen = load_manifest(path, nest_overrides([parse_override(o) for o in overrides]))
    assert chosen.train.device == "cuda:3"
    assert chosen.digest == load_manifest(path).digest  # a node's own choice
    with pytest.raises(ValueError, match="--gpu 1 and --set train.device both choose the device"):
        _gpu_overrides(1, ["train.device=cpu"])
    assert _gpu_overrides(None, []) == []

