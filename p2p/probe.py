"""A timed transfer of a few megabytes to a member: how fast this machine's link carries the
swarm's messages, measured through the transport every exchange uses (`doctor`).

Members serve probes (`serve_probe`): a push of at most PROBE_BYTES is read, verified and
dropped; a swap's reply is as many zero bytes as its asking half carried, at most PROBE_BYTES,
so a probe never makes a member send more than it received. The prober (`measure_link`)
pushes PROBE_BYTES, timed from the push's start to the member's acceptance (the uplink), then
swaps PROBE_BYTES each way: both halves travel at once, so the swap lasts as long as the
slower direction, and the downlink carried the reply at least that fast. Both rates include
the streams' opening and a round trip; the transport's own deadlines bound each transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from p2p.messages import OutgoingMessage

PROBE = "link.probe"
PROBE_BYTES = 4 << 20
_ZEROS = np.zeros(PROBE_BYTES, np.uint8)
_ZEROS.flags.writeable = False


def _any_round(_round: int) -> bool:
    return True


def probe_bytes(wire) -> int:
    """The most a probe carries under a swarm's WireLimits (p2p/sizing.py: they follow the
    swarm's messages, so a small model's limits may hold less than PROBE_BYTES)."""
    return min(PROBE_BYTES, wire.max_message_bytes, wire.max_tensors * wire.max_tensor_elements)


def _probe_message(nbytes: int, wire) -> OutgoingMessage:
    """`nbytes` of zeros in tensors no larger than the swarm's largest (`wire`: WireLimits)."""
    piece = wire.max_tensor_elements
    return OutgoingMessage.from_arrays(PROBE, 0, {f"zeros{i}": _ZEROS[start:min(nbytes, start + piece)]
                                                  for i, start in enumerate(range(0, nbytes, piece))})


def serve_probe(transport) -> None:
    """Answer other nodes' probes on `transport` (p2p.streams.Transport)."""
    async def drop(_received) -> None:
        return None

    async def reply(header) -> OutgoingMessage:
        return _probe_message(min(header.total, probe_bytes(transport.wire_limits)), transport.wire_limits)
    fits = lambda nbytes: nbytes <= probe_bytes(transport.wire_limits)  # noqa: E731
    transport.on_push(PROBE, drop, accept_round=_any_round, accept_bytes=fits)
    transport.on_swap(PROBE, reply, accept_round=_any_round, accept_bytes=fits)


@dataclass(frozen=True)
class LinkMeasurement:
    """Rates in bit/s: the uplink's, and the downlink's lower bound."""

    peer: str
    nbytes: int
    up_bps: float
    down_bps_at_least: float


async def measure_link(transport, peer: str, nbytes: int | None = None) -> LinkMeasurement:
    """Push then swap `nbytes` (default `probe_bytes`: members refuse more) with `peer`, in
    tensors the swarm's limits accept; raises the transport's errors (P2PError)."""
    wire = transport.wire_limits
    nbytes = nbytes or probe_bytes(wire)
    if not 0 < nbytes <= probe_bytes(wire):
        raise ValueError(f"a probe carries 1 to {probe_bytes(wire)} bytes, not {nbytes}")
    started = time.monotonic()
    await transport.push(peer, _probe_message(nbytes, wire))
    pushed = time.monotonic() - started
    started = time.monotonic()
    reply = await transport.swap(peer, _probe_message(nbytes, wire), accept_round=_any_round,
                                 expected_reply_bytes=nbytes)
    swapped = time.monotonic() - started
    return LinkMeasurement(str(peer), nbytes, 8 * nbytes / pushed, 8 * len(reply.payload) / swapped)
