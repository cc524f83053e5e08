"""What the outer algorithms share: operations on dicts of named fp32 tensors.

A model's state travels through protocol/ as `NamedTensors`, a dict name -> torch.Tensor. The
outer state (φ, momentum, residual) is always fp32 (docs/protocols.md §0), so every entry point
copies its inputs with `fp32_clone` and checks layouts with `check_same_layout` before any
arithmetic. Functions here return new dicts and leave their arguments alone, except
`shift_in_place`, which adds a shift into the caller's tensors (its name says so).

Invariant: nothing protocol/ returns or keeps carries autograd history. Live parameters require
grad, and a result computed from them with grad on links to the previous round's state: a node's
φ and δ then hold an autograd graph that grows by a few nodes per tensor every round, without
bound (memray found it the largest growing allocation of the soak's daemons). Every
function here that reads a caller's tensors detaches them first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import blake3
import torch

from protocol.errors import LayoutError

NamedTensors = dict[str, torch.Tensor]
"""name -> tensor, e.g. a model's parameters; protocol/ keeps these in fp32."""


def fp32_clone(tensors: Mapping[str, torch.Tensor], *, what: str = "tensors",
               device: torch.device | None = None) -> NamedTensors:
    """Detached, contiguous fp32 copies, so that later in-place training cannot alias our state;
    on `device` if given (else where each tensor is)."""
    if not isinstance(tensors, Mapping):
        raise LayoutError(f"{what} must be a mapping of name to tensor, got {type(tensors).__name__}.")
    copies: NamedTensors = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise LayoutError(f"{what} has a non-string name {name!r}.")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise LayoutError(f"{what}[{name!r}] must be a floating-point tensor.")
        copies[name] = tensor.detach().to(device=device or tensor.device, dtype=torch.float32,
                                          copy=True).contiguous()
    return copies


def check_same_layout(reference: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor],
                      *, what: str) -> None:
    """Raise LayoutError unless `other` holds exactly the names and shapes of `reference`."""
    if not isinstance(reference, Mapping):
        raise LayoutError(f"the reference for {what} must be a mapping of name to tensor.")
    if not isinstance(other, Mapping):
        raise LayoutError(f"{what} must be a mapping of name to tensor, got {type(other).__name__}.")
    if reference.keys() != other.keys():
        missing = sorted(set(reference) - set(other))
        extra = sorted(set(other) - set(reference))
        raise LayoutError(f"{what} has different tensor names: missing {missing[:5]}, extra {extra[:5]}.")
    for name, ref in reference.items():
        tensor = other[name]
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{what}[{name!r}] is a {type(tensor).__name__}, not a tensor.")
        if tensor.shape != ref.shape:
            raise LayoutError(f"{what}[{name!r}] has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(ref.shape)}.")


def zeros_like(tensors: Mapping[str, torch.Tensor]) -> NamedTensors:
    """fp32 zeros with the layout of `tensors` (initial momentum and residual)."""
    return {name: torch.zeros_like(t, dtype=torch.float32) for name, t in tensors.items()}


def difference(minuend: Mapping[str, torch.Tensor],
               subtrahend: Mapping[str, torch.Tensor]) -> NamedTensors:
    """minuend − subtrahend per name, in fp32 (both pseudo-gradient signs are built from this)."""
    check_same_layout(minuend, subtrahend, what="subtrahend")
    return {name: minuend[name].detach().float() - subtrahend[name].detach().float() for name in minuend}


@torch.no_grad()
def shift_in_place(tensors: Mapping[str, torch.Tensor], shift: Mapping[str, torch.Tensor]) -> None:
    """tensors += shift per name, in place (live parameters included: no autograd record)."""
    check_same_layout(tensors, shift, what="shift")
    for name, tensor in tensors.items():
        tensor.add_(shift[name].to(device=tensor.device, dtype=tensor.dtype))


def mean(tensor_dicts: Iterable[Mapping[str, torch.Tensor]], divisor: float | None = None
         ) -> NamedTensors:
    """Elementwise sum of several dicts, in the order given, over `divisor` (default: their
    count, the mean).

    Summation order is part of the result in floating point: callers that need bitwise equal
    means on several nodes (DiLoCo, DiLoCoX) must pass the dicts in one canonical order. The
    iterable is consumed lazily, so only the running sum and one summand are held at a time.
    """
    total: NamedTensors | None = None
    count = 0
    for tensors in tensor_dicts:
        if total is None:
            total = fp32_clone(tensors, what="first summand")
        else:
            check_same_layout(total, tensors, what=f"summand {count}")
            for name, tensor in tensors.items():
                total[name].add_(tensor.detach().to(torch.float32))
        count += 1
    if total is None:
        raise LayoutError("mean of no tensor dicts is undefined; pass at least one.")
    for tensor in total.values():
        tensor.div_(count if divisor is None else divisor)
    return total


def squared_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """Σ x² over every tensor, rounded alike on every node: for each tensor, the fp32 squares
    summed pairwise (x[:n/2] + x[n/2:], halving until one is left, a zero padding an odd
    length), and the tensors' sums added as Python floats in the mapping's order.

    torch's sum() accumulates in an order its kernel picks for the CPU's vector width, so two
    nodes on different hardware could scale the same message differently and split φ
    (benchmarks/NOTEBOOK.md, "DiLoCoX against DiLoCo and local-only", median clipping). A square
    and an elementwise add are each one IEEE operation, rounded the same whatever the vector width
    or device.
    """
    total = 0.0
    for tensor in tensors.values():
        values = tensor.detach().reshape(-1).to(torch.float32).square()
        while values.numel() > 1:
            if values.numel() % 2:
                values = torch.cat([values, values.new_zeros(1)])
            half = values.numel() // 2
            values = values[:half] + values[half:]
        total += float(values[0]) if values.numel() else 0.0
    return total


def numel(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total number of elements over all named tensors."""
    return sum(t.numel() for t in tensors.values())


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """BLAKE3 digest (128 bits, hex) of names, shapes and fp32 bytes, in sorted name order.

    Nodes publish it every round to detect diverged φ (docs/protocols.md §3 "Consistency"); equal
    digests mean bitwise equal weights. It is taken in the training thread at each round's end:
    BLAKE3 on all cores hashes a `small` model's 536 MB in a fraction of the time BLAKE2b took
    on one, and host bytes are hashed where they lie, not copied first. Bytes on a GPU cross
    through pinned buffers in turn (`HostStaging`), while the previous piece is hashed.
    """
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    staging = HostStaging()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to(dtype=torch.float32).contiguous()  # on its device
        staging.put(name.encode("utf-8") + b"\0" + repr(tuple(tensor.shape)).encode("ascii"), digest)
        flat = tensor.reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            staging.put(flat.numpy(), digest)
        else:
            for start in range(0, flat.numel(), staging.piece_bytes):
                staging.put(flat[start:start + staging.piece_bytes], digest)
    staging.drain(digest)
    return digest.hexdigest(length=16)


class HostStaging:
    """Bytes fed in order to a hash, device pieces through two host buffers in turn.

    `put` takes host bytes (hashed in their turn) or a flat uint8 tensor of at most
    `piece_bytes` (copied into the next buffer: pinned and asynchronous from a CUDA device, so
    the copy engine fills one buffer while the other is hashed). Before a buffer is reused, what
    was queued up to its last use is hashed: the hash sees every byte in the order given.
    """

    piece_bytes = 32 << 20

    def __init__(self, piece_bytes: int | None = None):
        self.piece_bytes = piece_bytes or self.piece_bytes
        self.buffers: list[torch.Tensor] = []
        self.queue: list[tuple[object, object]] = []  # (bytes or host tensor, copy done event)
        self.turn = 0

    def put(self, piece, digest) -> None:
        if not isinstance(piece, torch.Tensor):  # host bytes: now, unless device pieces are ahead
            if self.queue:
                self.queue.append((piece, None))
            else:
                digest.update(piece)
            return
        while sum(isinstance(item, torch.Tensor) for item, _ in self.queue) > 1:
            self._hash_first(digest)  # the buffer this piece goes into is hashed and free
        cuda = piece.device.type == "cuda"
        if len(self.buffers) < 2:
            self.buffers.append(torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=cuda))
        host = self.buffers[self.turn % 2][:piece.numel()]
        self.turn += 1
        host.copy_(piece, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(piece.device))
        self.queue.append((host, done))

    def drain(self, digest) -> None:
        while self.queue:
            self._hash_first(digest)

    def _hash_first(self, digest) -> None:
        item, done = self.queue.pop(0)
        if done is not None:
            done.synchronize()
        digest.update(item.numpy() if isinstance(item, torch.Tensor) else item)
