"""Bounds on what a peer may send us, and the accounting that enforces them at run time.

`WireLimits` are the static bounds every header is checked against *before* anything is
allocated. `TransferLimits` are the run-time knobs of the transport (parallel streams, frame
size, the stall bound, per-peer concurrency). `InflightLedger` reserves streams and bytes per peer and
globally, so that no peer, and no crowd of peers, can make this node hold more than the
configured memory for incoming payloads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def described(default, meaning: str):
    """A settings field with its unit and meaning (TransferLimits here, node/config/settings.py's
    NodeTimeouts too; `lowcomm-node settings` lists them)."""
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True)
class WireLimits:
    """Static bounds on one message, checked on its header before allocation."""

    max_header_bytes: int = 256 * KiB        # msgpack header, tensor manifest included
    max_message_bytes: int = 8 * GiB         # whole payload of one message (all frames)
    max_tensors: int = 4096                  # entries in the tensor manifest
    max_name_bytes: int = 256                # UTF-8 bytes of a tensor name
    max_ndim: int = 8                        # dimensions of one tensor
    max_tensor_elements: int = 1 << 32      # elements of one tensor (a 4-G element embedding)
    max_meta_entries: int = 32               # small application fields in the header
    max_meta_value_bytes: int = 1024         # bytes of one str/bytes meta value
    max_streams_per_message: int = 16        # parallel streams one message may be split over
    min_frame_bytes: int = 64 * KiB          # smaller frames only cost signatures
    max_frame_bytes: int = 256 * MiB         # one frame's payload: bounds a single read phase
    max_clock_skew_s: float = 300.0          # sender timestamps further off are EXPIRED

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"WireLimits.{name} must be positive, got {value!r}.")
        if self.min_frame_bytes > self.max_frame_bytes:
            raise ValueError("WireLimits.min_frame_bytes must not exceed max_frame_bytes.")


@dataclass(frozen=True)
class TransferLimits:
    """Run-time knobs of the transport; defaults suit a home uplink and a model of a few GB.

    No transfer that keeps moving is cut by a fixed time (p2p/progress.py): an exchange ends when
    done, when none of its streams moved a byte either way for `stall_s`, or when even at
    `min_rate_bytes_per_s` its remaining bytes could not arrive by its need-by (the caller's, or
    by default `need_by_s` of its bytes). Every field but `min_rate_bytes_per_s` is this node's
    to choose (`lowcomm-node join --set node.<name>=<value>`); `min_rate_bytes_per_s` is the
    swarm's declared minimum link rate, which the node sets from its manifest
    (protocol.min_link_mbit_s), so that every member bounds a transfer alike.
    """

    parallel_streams: int = described(4, "streams per large message (one yamux stream is window-limited)")
    frame_bytes: int = described(8 * MiB, "bytes: payload per signed frame (frames pipeline hashing and sending)")
    chunk_bytes: int = described(1 * MiB, "bytes: write granularity (drain between chunks)")
    max_streams_per_peer: int = described(16, "concurrent incoming streams from one peer")
    max_inflight_bytes_per_peer: int = described(4 * GiB, "bytes: incoming payload held for one peer "
                                                 "(raised to two of the swarm's largest message)")
    max_inflight_bytes: int = described(16 * GiB, "bytes: incoming payload held for all peers together")
    open_timeout_s: float = described(10.0, "seconds: opening a stream to a peer")
    stall_s: float = described(30.0, "seconds: an exchange none of whose streams moved a byte, either "
                               "way, for this long is given up")
    min_rate_bytes_per_s: float = described(125_000.0, "bytes/s: the swarm's minimum link rate (from "
                                            "the manifest's protocol.min_link_mbit_s, not a node setting)")
    reply_timeout_s: float = described(30.0, "seconds: a handler's reply(header) and deliver(message) "
                                       "must return within this (local work, no bytes moved)")

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"TransferLimits.{name} must be positive, got {value!r}.")

    def need_by_s(self, payload_bytes: int) -> float:
        """The default need-by of an exchange whose larger direction carries `payload_bytes`:
        what they take at the swarm's minimum link rate, plus one stall's worth of setup."""
        return self.stall_s + payload_bytes / self.min_rate_bytes_per_s


NODE_SWARM_FIELDS = ("min_rate_bytes_per_s",)  # set from the manifest, never by one node


class InflightLedger:
    """Counts open incoming streams and reserved payload bytes, per peer and in total.

    `try_open_stream` / `close_stream` bracket a stream's life; `try_reserve` / `release`
    bracket a receive buffer's life. Both refuse (return False) instead of waiting, so a
    flooding peer is answered BUSY at once and never queues work on us.
    """

    def __init__(self, limits: TransferLimits):
        self.limits = limits
        self._streams: dict[bytes, int] = defaultdict(int)
        self._bytes: dict[bytes, int] = defaultdict(int)
        self.total_bytes = 0

    def try_open_stream(self, peer: bytes) -> bool:
        if self._streams[peer] >= self.limits.max_streams_per_peer:
            return False
        self._streams[peer] += 1
        return True

    def close_stream(self, peer: bytes) -> None:
        self._streams[peer] -= 1
        if self._streams[peer] <= 0:
            del self._streams[peer]

    def try_reserve(self, peer: bytes, nbytes: int) -> bool:
        if (self._bytes[peer] + nbytes > self.limits.max_inflight_bytes_per_peer
                or self.total_bytes + nbytes > self.limits.max_inflight_bytes):
            if not self._bytes[peer]:
                del self._bytes[peer]
            return False
        self._bytes[peer] += nbytes
        self.total_bytes += nbytes
        return True

    def release(self, peer: bytes, nbytes: int) -> None:
        self._bytes[peer] -= nbytes
        self.total_bytes -= nbytes
        if self._bytes[peer] <= 0:
            del self._bytes[peer]

    def open_streams(self, peer: bytes) -> int:
        return self._streams.get(peer, 0)

    def reserved_bytes(self, peer: bytes) -> int:
        return self._bytes.get(peer, 0)
