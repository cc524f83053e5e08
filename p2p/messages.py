"""What callers hand to the transport and what it hands back: named tensors as raw bytes.

The network layer does not depend on torch. A tensor travels as (name, dtype, shape, bytes);
`OutgoingTensor` accepts any C-contiguous buffer (a numpy array, bytes, a memoryview), and
`ReceivedMessage` exposes zero-copy memoryviews and numpy views of the received payload.

From torch, on the daemon's side (no copy for contiguous CPU tensors):

    OutgoingTensor(name, "bfloat16", tuple(t.shape), t.contiguous().view(torch.uint8).numpy())
    torch.frombuffer(received.tensor_bytes(name), dtype=torch.bfloat16).view(shape)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hivemind.p2p import PeerID

from p2p.wire import DTYPE_SIZES, MessageHeader, Mode, TensorEntry

# numpy dtypes for the wire dtypes; bfloat16 has no numpy type, its bits travel as uint16.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64), "float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16), "int64": np.dtype(np.int64), "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16), "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "bool": np.dtype(np.bool_),
}
_WIRE_DTYPE_OF_NUMPY = {dt: name for name, dt in NUMPY_DTYPES.items() if name != "bfloat16"}


@dataclass(frozen=True)
class OutgoingTensor:
    """One tensor to send: its bytes must be exactly prod(shape) * itemsize, C-contiguous."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any  # any object with the buffer protocol

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}.")
        view = memoryview(self.data)
        if not view.c_contiguous:
            raise ValueError(f"tensor {self.name!r}: its buffer is not C-contiguous; pass a contiguous copy.")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if view.nbytes != expected:
            raise ValueError(f"tensor {self.name!r}: buffer has {view.nbytes} bytes, shape {tuple(self.shape)} "
                             f"of {self.dtype} needs {expected}.")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @classmethod
    def from_array(cls, name: str, array: np.ndarray, dtype: str | None = None) -> "OutgoingTensor":
        """From a numpy array; `dtype` overrides the wire dtype (e.g. "bfloat16" for uint16 bits)."""
        array = np.ascontiguousarray(array)
        if dtype is None:
            if array.dtype not in _WIRE_DTYPE_OF_NUMPY:
                raise ValueError(f"tensor {name!r}: numpy dtype {array.dtype} has no wire dtype.")
            dtype = _WIRE_DTYPE_OF_NUMPY[array.dtype]
        return cls(name, dtype, tuple(array.shape), array)

    def entry(self) -> TensorEntry:
        return TensorEntry(self.name, self.dtype, self.shape, memoryview(self.data).nbytes)

    def byte_view(self) -> memoryview:
        view = memoryview(self.data)
        return view.cast("B") if view.ndim != 1 or view.format != "B" else view


@dataclass
class OutgoingMessage:
    """A message to push, swap or reply with: a kind, a round, tensors and a few small fields.

    `meta` holds small scalars for the receiver (e.g. a loss, a step count, a state digest);
    it travels in the signed header, so keep it under `WireLimits.max_meta_entries` entries.
    Frame digests are cached on the message, so sending one message to many peers hashes it
    once: do not modify the tensors' memory while the message may still be sent.
    """

    kind: str
    round: int
    tensors: Sequence[OutgoingTensor] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    frame_digests: dict[tuple[int, int], bytes] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"message {self.kind!r} has duplicate tensor names.")
        if type(self.round) is not int or self.round < 0:
            raise ValueError(f"message {self.kind!r}: round must be a natural number, got {self.round!r}.")

    @classmethod
    def from_arrays(cls, kind: str, round: int, arrays: Mapping[str, np.ndarray],
                    meta: dict[str, Any] | None = None) -> "OutgoingMessage":
        return cls(kind, round, [OutgoingTensor.from_array(n, a) for n, a in arrays.items()], dict(meta or {}))

    def manifest(self) -> tuple[TensorEntry, ...]:
        return tuple(t.entry() for t in self.tensors)

    def segments(self) -> list[memoryview]:
        """The payload as consecutive byte views, one per tensor (never concatenated)."""
        return [t.byte_view() for t in self.tensors]

    @property
    def total_bytes(self) -> int:
        return sum(memoryview(t.data).nbytes for t in self.tensors)


def slice_segments(segments: Sequence[memoryview], start: int, stop: int) -> Iterator[memoryview]:
    """Yield views covering bytes [start, stop) of the concatenation of `segments`, no copies."""
    position = 0
    for segment in segments:
        end = position + len(segment)
        if end > start and position < stop:
            yield segment[max(start, position) - position:min(stop, end) - position]
        position = end
        if position >= stop:
            break


@dataclass
class ReceivedMessage:
    """A complete message whose every frame passed every check.

    `payload` is the whole received buffer; tensors are views into it (valid as long as this
    object or a view of it lives). `header` is the first frame's header (message-level fields).
    """

    sender: PeerID
    header: MessageHeader
    tensors: tuple[TensorEntry, ...]
    payload: memoryview

    kind = property(lambda self: self.header.kind)
    round = property(lambda self: self.header.round)
    mode = property(lambda self: self.header.mode)
    meta = property(lambda self: self.header.meta)
    nonce = property(lambda self: self.header.nonce)

    def tensor_views(self) -> dict[str, tuple[TensorEntry, memoryview]]:
        views, offset = {}, 0
        for entry in self.tensors:
            views[entry.name] = (entry, self.payload[offset:offset + entry.nbytes])
            offset += entry.nbytes
        return views

    def tensor_bytes(self, name: str) -> memoryview:
        return self.tensor_views()[name][1]

    def arrays(self) -> dict[str, np.ndarray]:
        """numpy views (no copy) of every tensor; bfloat16 tensors come as their uint16 bits."""
        return {name: np.frombuffer(view, dtype=NUMPY_DTYPES[entry.dtype]).reshape(entry.shape)
                for name, (entry, view) in self.tensor_views().items()}

    def __repr__(self) -> str:
        return (f"ReceivedMessage({Mode.NAMES.get(self.mode)} {self.kind!r} round {self.round} from "
                f"{self.sender.to_base58()[:16]}…, {len(self.tensors)} tensors, {len(self.payload)} bytes)")
