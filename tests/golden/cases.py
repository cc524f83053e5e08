"""The golden-bits cases: every outer step and every codec on fixed inputs, and the digests of
their outputs' bytes.

Members of a swarm must compute the same bits: DiLoCoX's φ is agreed bit for bit (every node
sums the same decoded messages in the same order), and a NoLoCo or DiLoCo step that rounds
differently on one release splits a swarm of mixed releases without an error. The inputs are
made from BLAKE2b output alone (`fixed_tensor`), not from any random generator, so a change of
torch's or numpy's generators cannot move them; the codecs' own seeded generators (the low-rank
warm start) are part of what is checked. Each case returns named parts (tensors or bytes); its
digest per part is BLAKE2b-256 over each tensor's name, dtype, shape and little-endian bytes in
name order. tests/golden/outer_steps.json holds the expected digests and tests/golden/payloads.msgpack the
stored encodings (tests/golden/regen.py writes both); tests/unit/test_golden_bits.py checks them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

import msgpack
import numpy as np
import torch

from protocol.codecs import Encoded, decode, get_codec
from protocol.diloco import DiLoCo, DiLoCoHyperParameters
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters, PseudoGradientMessage
from protocol.noloco import NoLoCo, NoLoCoHyperParameters, NoLoCoSnapshot, theta_only_snapshot

# a model's worth of tensor shapes: two matrices the low-rank codec factors (>= 4096 elements,
# whole topk chunks and a partial one), a vector and a small matrix it sends blockwise
SHAPES = {"emb": (96, 64), "layers.0.w": (64, 80), "layers.0.b": (80,), "norm": (8, 8)}
# every codec a manifest can name, at its defaults and at its other bit widths
CODECS: dict[str, tuple[str, dict]] = {
    "identity": ("identity", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "blockwise8": ("blockwise", {"bits": 8}),
    "blockwise4": ("blockwise", {"bits": 4}),
    "lowrank8": ("lowrank", {"rank": 4, "bits": 8, "iterations": 4}),
    "lowrank4": ("lowrank", {"rank": 4, "bits": 4, "iterations": 4}),
    "topk2": ("topk", {"k": 64, "chunk": 4096, "bits": 2}),
    "topk4": ("topk", {"k": 64, "chunk": 4096, "bits": 4}),
    "topk8": ("topk", {"k": 64, "chunk": 4096, "bits": 8}),
}
Part = Mapping[str, torch.Tensor] | bytes


def fixed_tensor(label: str, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """fp32 values in [-scale, scale) from BLAKE2b(label, counter): the same bits everywhere."""
    count = int(np.prod(shape))
    stream = b"".join(hashlib.blake2b(f"{label}/{block}".encode(), digest_size=64).digest()
                      for block in range((4 * count + 63) // 64))
    words = np.frombuffer(stream[:4 * count], dtype="<u4") >> np.uint32(8)  # 24 bits: exact below
    values = (words.astype(np.float64) * 2.0 ** -23 - 1.0) * scale
    return torch.from_numpy(values.astype(np.float32).reshape(shape))


def fixed_weights(label: str, scale: float) -> dict[str, torch.Tensor]:
    return {name: fixed_tensor(f"{label}/{name}", shape, scale) for name, shape in SHAPES.items()}


def digest(part: Part) -> str:
    hasher = hashlib.blake2b(digest_size=32)
    if isinstance(part, bytes):
        hasher.update(part)
        return hasher.hexdigest()
    for name in sorted(part):
        tensor = part[name].detach().to("cpu").contiguous()
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        hasher.update(tensor.numpy().tobytes())  # little-endian: protocol/codecs refuses other machines
    return hasher.hexdigest()


def _wire(description: Mapping, payload: bytes) -> bytes:
    return msgpack.packb(dict(sorted(description.items())), use_bin_type=True) + payload


# ---------------------------------------------------------------------------------- cases
# Encoders may differ by CPU where only the sender's compute depends on them (the low-rank
# codec's power iterations use matmul); decoders and the outer step must not. So the encodings
# of these codecs, and the DiLoCoX messages of these, are stored (tests/golden/payloads.msgpack)
# and decoded or applied as stored: those digests check the receivers' arithmetic alone.
STORED_ENCODINGS = ("blockwise8", "blockwise4", "lowrank8", "lowrank4", "topk2", "topk4", "topk8")
STORED_MESSAGES = ("lowrank8", "lowrank4", "topk2", "topk4", "topk8")
Stored = Mapping[str, list]


def codec_encodings(key: str) -> list[list]:
    """[tensor name, description, payload] of two rounds of encoding (the second warm-started
    where the codec keeps state)."""
    name, params = CODECS[key]
    codec = get_codec(name, **params)
    return [[f"{round_index}/{tensor_name}", *astuple_encoded(codec.encode(tensor, tensor_name))]
            for round_index in range(2)
            for tensor_name, tensor in fixed_weights(f"codec input {round_index}", 2.0 ** -4).items()]


def astuple_encoded(encoded) -> list:
    return [dict(sorted(encoded.description.items())), encoded.payload]


def codec_case(key: str, stored: Stored) -> dict[str, Part]:
    """What the encoder sends, and what the receiver's `decode` makes of it (of the stored
    encodings where there are)."""
    encodings = codec_encodings(key)
    decoded = {name: decode(description, payload, max_elements=1 << 20)
               for name, description, payload in stored.get(f"codec/{key}", encodings)}
    return {"encoded": b"".join(_wire(d, p) for _, d, p in encodings), "decoded": decoded}


def diloco_case() -> dict[str, Part]:
    """Three outer steps of DiLoCo (Nesterov, η 0.7, μ 0.9) over three nodes' pseudo-gradients."""
    node = DiLoCo(fixed_weights("diloco initial", 0.5), DiLoCoHyperParameters(0.7, 0.9))
    for round_index in range(3):
        node.outer_step([fixed_weights(f"diloco delta {n} {round_index}", 2.0 ** -6) for n in range(3)])
    return {"phi": node.slow_weights, "momentum": node.momentum}


def _dilocox_hyper(noise_filter: bool) -> DiLoCoXHyperParameters:
    """The manifest's defaults: delay 1, λ ½, median clipping; the noise filter on request."""
    return DiLoCoXHyperParameters(outer=DiLoCoHyperParameters(0.7, 0.3), delay=1, clip_to_median=True,
                                  noise_ratio=0.1 if noise_filter else 0.0)


def dilocox_messages(key: str, noise_filter: bool = False) -> tuple[list[DiLoCoX], list[list]]:
    """Three rounds of three DiLoCoX nodes exchanging every message: the nodes, and every
    message as [sender, round, rounds carried, [[tensor name, description, payload], ...]]."""
    name, params = CODECS[key]
    initial = fixed_weights("dilocox initial", 0.5)
    nodes = [DiLoCoX(initial, get_codec(name, **params), node_id, _dilocox_hyper(noise_filter))
             for node_id in "abc"]
    sent = []
    for round_index in range(3):
        messages = []
        for node in nodes:
            start = node.round_start_weights()
            progress = fixed_weights(f"dilocox progress {node.node_id} {round_index}", 2.0 ** -6)
            messages.append(node.compress(node.pseudo_gradient(
                {n: start[n] - progress[n] for n in start}), round_index))
        for node in nodes:
            for message in messages:
                if message.sender != node.node_id:
                    node.receive(message)
            node.outer_step(round_index)
        sent += [[m.sender, m.round_index, m.rounds,
                  [[n, *astuple_encoded(e)] for n, e in sorted(m.tensors.items())]] for m in messages]
    phis = [digest(node.slow_weights) for node in nodes]
    assert len(set(phis)) == 1, f"DiLoCoX nodes on {key} disagree on φ: {phis}"
    return nodes, sent


def dilocox_case(key: str, stored: Stored, noise_filter: bool = False) -> dict[str, Part]:
    """φ, m and e of a node after three rounds, the messages sent; and, from the stored
    messages, the φ and m of an observer that only receives and applies them."""
    nodes, sent = dilocox_messages(key, noise_filter)
    first = nodes[0]
    parts: dict[str, Part] = {
        "phi": first.slow_weights, "momentum": first.momentum, "residual": first.residual,
        "messages": b"".join(_wire(d, p) for *_, tensors in sent for _, d, p in tensors)}
    if f"dilocox/{key}" in stored and not noise_filter:
        name, params = CODECS[key]
        observer = DiLoCoX(fixed_weights("dilocox initial", 0.5), get_codec(name, **params), "z",
                           _dilocox_hyper(noise_filter))
        for round_index in range(3):
            for sender, index, rounds, tensors in stored[f"dilocox/{key}"]:
                if index == round_index:
                    observer.receive(PseudoGradientMessage(
                        sender, index, {n: Encoded(d, p) for n, d, p in tensors}, rounds))
            observer.outer_step(round_index)
        parts["applied"] = {**{f"phi/{n}": t for n, t in observer.slow_weights.items()},
                            **{f"momentum/{n}": t for n, t in observer.momentum.items()}}
    return parts


def payloads() -> dict[str, list]:
    """What tests/golden/payloads.msgpack stores (regen.py writes it with the digests)."""
    stored = {f"codec/{key}": codec_encodings(key) for key in STORED_ENCODINGS}
    stored.update({f"dilocox/{key}": dilocox_messages(key)[1] for key in STORED_MESSAGES})
    return stored


def noloco_case() -> dict[str, Part]:
    """NoLoCo's outer step with a θ-only partner, then with a φ-Δ partner and a θ-only one
    (a group of three), then the overlap timing's late correction (α 0.5, β = γ = 0.7)."""
    hyper = NoLoCoHyperParameters()
    node = NoLoCo(fixed_weights("noloco initial", 0.5), hyper)

    def theta(label: str, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        progress = fixed_weights(label, 2.0 ** -6)
        return {n: base[n] + progress[n] for n in base}
    own = node.snapshot(theta("noloco own 0", node.slow_weights))
    node.outer_step(own, [theta_only_snapshot(theta("noloco partner 0", node.slow_weights), hyper)])
    own = node.snapshot(theta("noloco own 1", node.slow_weights))
    other_phi = fixed_weights("noloco partner phi 1", 0.5)
    partners = [NoLoCoSnapshot(other_phi, fixed_weights("noloco partner delta 1", 2.0 ** -6)),
                theta_only_snapshot(theta("noloco partner 1", node.slow_weights), hyper)]
    node.outer_step(own, partners)
    own = node.snapshot(theta("noloco own 2", node.slow_weights))
    node.outer_step(own)  # alone: the local update
    correction = node.late_pair_correction(
        own, [theta_only_snapshot(theta("noloco partner 2", own.slow_weights), hyper)])
    return {"phi": node.slow_weights, "momentum": node.outer_momentum, "correction": correction}


def all_cases(stored: Stored) -> dict[str, Callable[[], dict[str, Part]]]:
    """Every case by name, reading `stored` (payloads.msgpack's contents)."""
    cases: dict[str, Callable[[], dict[str, Part]]] = {"diloco": diloco_case, "noloco": noloco_case}
    for key in CODECS:
        cases[f"codec/{key}"] = lambda key=key: codec_case(key, stored)
        cases[f"dilocox/{key}"] = lambda key=key: dilocox_case(key, stored)
    cases["dilocox/topk2+noise_filter"] = lambda: dilocox_case("topk2", stored, noise_filter=True)
    return cases


def pinned(case: str, part: str) -> bool:
    """Whether a part's bits must be the same on every machine. Not so where only a sender
    computes them from the low-rank encoder: its power iterations use matmul, whose rounding
    follows the CPU's kernels (measured: the encodings differ under ATEN_CPU_CAPABILITY=default
    against AVX-512, while the stored encodings decode, and the stored messages apply, to the
    same bits). What receivers compute from them is pinned: "decoded" and "applied"."""
    return not ("lowrank" in case and part in ("encoded", "messages", "phi", "momentum", "residual"))


def digests(name: str, case: Callable[[], dict[str, Part]]) -> dict[str, str]:
    """The digests of a case's pinned parts (its other parts are still computed: the DiLoCoX
    runs check that every node holds the same φ)."""
    return {part: digest(value) for part, value in case().items() if pinned(name, part)}


def read_payloads(path) -> dict[str, list]:
    return msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
