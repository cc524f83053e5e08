import os

import pytest
import torch

from node.train.checkpoint import CheckpointError, CheckpointStore


def state(step):
    return {"step": step, "w": torch.full((3,), float(step)), "nested": {"rng": torch.arange(4)}}


def test_save_load_keeps_the_last_two(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (10, 20, 30):
        store.save(state(step), step)
    assert [p.name for p in store.paths()] == ["ckpt-0000000030.pt", "ckpt-0000000020.pt"]
    loaded = store.load_latest()
    assert loaded.state["step"] == 30 and torch.equal(loaded.state["w"], torch.full((3,), 30.0))
    assert os.stat(loaded.path).st_size > 40


def test_a_save_numbered_below_the_others_is_the_one_resumed_from(tmp_path):
    """A NoLoCo node that ran ahead of its swarm goes back to the swarm's round, its step
    counter with it: the checkpoints numbered above its next save are older than that save."""
    store = CheckpointStore(tmp_path)
    for step in (180, 200, 120):
        store.save(state(step), step)
    assert [p.name for p in store.paths()] == ["ckpt-0000000120.pt"]
    assert store.load_latest().state["step"] == 120
    store.save(state(140), 140)
    assert [p.name for p in store.paths()] == ["ckpt-0000000140.pt", "ckpt-0000000120.pt"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_newest_falls_back_to_previous_with_a_reason(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    store.save(state(1), 1)
    newest = store.save(state(2), 2)
    blob = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        newest.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])
    else:
        newest.write_bytes(b"")
    loaded = store.load_latest()
    assert loaded.state["step"] == 1
    assert len(loaded.skipped) == 1
    assert "ckpt-0000000002.pt" in loaded.skipped[0]
    assert "using the previous checkpoint instead" in loaded.skipped[0]


def test_all_corrupt_is_an_error_not_a_silent_fresh_start(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(state(1), 1).write_bytes(b"LCNCKPT1" + b"\0" * 50)
    with pytest.raises(CheckpointError, match="no readable checkpoint is left"):
        store.load_latest()


def test_empty_directory_has_no_checkpoint(tmp_path):
    assert CheckpointStore(tmp_path / "none").load_latest() is None


def test_a_write_killed_midway_leaves_only_a_temporary(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(state(1), 1)
    (tmp_path / ".ckpt-0000000002.pt.tmp-123").write_bytes(b"partial")
    assert store.load_latest().state["step"] == 1
    store.remove_stale_temporaries()
    assert not list(tmp_path.glob(".ckpt-*"))


def test_code_in_a_checkpoint_is_never_executed(tmp_path):
    import hashlib
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    payload = pickle.dumps(Evil())
    path = tmp_path / "ckpt-0000000009.pt"
    path.write_bytes(b"LCNCKPT1" + hashlib.blake2b(payload, digest_size=32).digest() + payload)
    with pytest.raises(CheckpointError):
        CheckpointStore(tmp_path).load_latest()
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_is_written_without_a_copy_of_it_in_memory(tmp_path):
    """It was encoded into one buffer, then copied twice: three times the state at the peak (a
    `medium` node's trainer and outer state are about 27 GB). Python-side allocations only:
    tracemalloc sees those copies, not the tensors torch writes from."""
    import tracemalloc
    big = {"w": torch.ones(10 * 2**20), "nested": {"m": torch.zeros(2**20)}}  # 44 MB
    tracemalloc.start()
    try:
        CheckpointStore(tmp_path).save(big, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.0f} MiB held while writing a 44 MB checkpoint"
    loaded = CheckpointStore(tmp_path).load_latest().state
    assert torch.equal(loaded["w"], big["w"]) and torch.equal(loaded["nested"]["m"], big["nested"]["m"])
