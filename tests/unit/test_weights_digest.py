"""φ's digest (protocol/tensors.py): the bytes it covers, and the staged path device bytes take.

The staged path is what a CUDA node's tensors go through (pinned buffers, asynchronous copies);
here it runs on host tensors with small pieces, so that its ordering is checked where CI runs.
tests/integration/test_cuda.py checks a CUDA digest against the host's on a GPU.
"""

import blake3
import torch

from protocol.tensors import HostStaging, weights_digest


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(37, 5, generator=generator),
            "a.bias": torch.randn(11, generator=generator),
            "c.scale": torch.randn(3, 3, 3, generator=generator).to(torch.bfloat16)}


def by_hand(named: dict[str, torch.Tensor]) -> str:
    digest = blake3.blake3()
    for name in sorted(named):
        tensor = named[name].to(torch.float32)
        digest.update(name.encode() + b"\0" + repr(tuple(tensor.shape)).encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(length=16)


def test_the_digest_covers_names_shapes_and_fp32_bytes_in_name_order():
    named = tensors()
    assert weights_digest(named) == by_hand(named)
    assert weights_digest(dict(reversed(named.items()))) == weights_digest(named)
    flipped = {k: v.clone() for k, v in named.items()}
    flipped["a.bias"].view(torch.int32)[4] ^= 1  # one bit of one element
    assert weights_digest(flipped) != weights_digest(named)
    reshaped = {**named, "b.weight": named["b.weight"].reshape(5, 37)}
    assert weights_digest(reshaped) != weights_digest(named)


def test_staged_pieces_reach_the_hash_in_the_order_given_whatever_their_size():
    """Headers between pieces, pieces of one tensor across both buffers, a piece shorter than
    a buffer: the same digest as hashing everything straight."""
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)  # 4000 distinct-ish bytes
    for piece_bytes in (1, 7, 64, 999, 4000, 10_000):
        straight, staged = blake3.blake3(), blake3.blake3()
        staging = HostStaging(piece_bytes)
        for header, start in ((b"first", 0), (b"second", 1500), (b"third", 3999)):
            end = min(start + 1500, 4000)
            straight.update(header)
            straight.update(data[start:end].numpy().tobytes())
            staging.put(header, staged)
            for at in range(start, end, piece_bytes):
                staging.put(data[at:min(at + piece_bytes, end)], staged)
        staging.drain(staged)
        assert staged.hexdigest() == straight.hexdigest(), piece_bytes
        assert len(staging.buffers) <= 2
