"""Transport limits that follow the messages a swarm exchanges, instead of constants.

The application describes the largest message of every kind it sends or accepts as a
`MessageBound` (the tensor manifest of that message: names, dtypes, shapes, bytes); `limits_for`
returns the `WireLimits` every header is checked against and the `TransferLimits` of the
in-flight ledger, chosen so that an honest peer's largest message always passes:

- `max_message_bytes`, `max_tensors`, `max_tensor_elements`: exactly the largest the bounds
  hold (a peer may claim no more than the swarm's largest message: every kind must be given);
  `max_name_bytes`: never below the default;
- `max_inflight_bytes_per_peer`: `CONCURRENT_PER_PEER` of the largest message at once (a swap
  still landing while the next starts, or a state reply next to a swap), never below the default;
  `max_inflight_bytes`: at least that.

It raises `LimitsError`, one sentence, when a message cannot fit the transport at all:
- its tensor manifest travels in a frame header, which is read before its signature is checked
  and so stays small (`WireLimits.max_header_bytes`, with `HEADER_RESERVE_BYTES` kept for the
  other fields and the application's meta fields);
- a message is received whole into one buffer of host memory: the largest must fit in
  `memory_bytes` (this machine's memory) when that is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import msgpack

from p2p.errors import LimitsError
from p2p.limits import TransferLimits, WireLimits
from p2p.wire import TensorEntry

CONCURRENT_PER_PEER = 2
# Header fields other than the tensor manifest: ids, digests, counts (under 1 KiB), and up to
# max_meta_entries meta values of max_meta_value_bytes (32 KiB by default).
HEADER_RESERVE_BYTES = 48 * 1024


@dataclass(frozen=True)
class MessageBound:
    """The largest message of one kind: `what` names it for people ("the late-join state")."""

    what: str
    tensors: tuple[TensorEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def manifest_bytes(self) -> int:
        """Bytes its tensor manifest takes in a frame header (msgpack, as p2p/wire.py encodes it)."""
        return len(msgpack.packb([t.to_wire() for t in self.tensors], use_bin_type=True))


def limits_for(bounds: Iterable[MessageBound], *, memory_bytes: int | None = None, remedy: str = "",
               wire: WireLimits = WireLimits(), transfer: TransferLimits = TransferLimits()
               ) -> tuple[WireLimits, TransferLimits]:
    """(WireLimits, TransferLimits) under which every message of `bounds` passes; LimitsError
    when one cannot fit the transport. `remedy` ends the error's sentence (what to change)."""
    bounds = list(bounds)
    if not bounds:
        return wire, transfer
    room = wire.max_header_bytes - HEADER_RESERVE_BYTES
    for bound in bounds:
        if bound.manifest_bytes() > room:
            raise LimitsError(f"{bound.what} has {len(bound.tensors)} tensors, whose manifest takes "
                              f"{bound.manifest_bytes()} bytes, more than the {room} a frame header "
                              f"holds for it{_then(remedy)}")
    largest = max(bounds, key=lambda b: b.total_bytes)
    if memory_bytes is not None and largest.total_bytes > memory_bytes:
        raise LimitsError(f"{largest.what} is {_gb(largest.total_bytes)}, and a message is received "
                          f"whole into host memory, but this machine has {_gb(memory_bytes)} of "
                          f"memory{_then(remedy)}")
    entries = [t for b in bounds for t in b.tensors]
    wire = replace(wire, max_message_bytes=max(1, largest.total_bytes),
                   max_tensors=max(1, *(len(b.tensors) for b in bounds)),
                   max_tensor_elements=max([1, *(math.prod(t.shape) for t in entries)]),
                   max_name_bytes=max([wire.max_name_bytes, *(len(t.name.encode()) for t in entries)]))
    per_peer = max(transfer.max_inflight_bytes_per_peer, CONCURRENT_PER_PEER * largest.total_bytes)
    transfer = replace(transfer, max_inflight_bytes_per_peer=per_peer,
                       max_inflight_bytes=max(transfer.max_inflight_bytes, per_peer))
    return wire, transfer


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _then(remedy: str) -> str:
    return f": {remedy}" if remedy else ""
