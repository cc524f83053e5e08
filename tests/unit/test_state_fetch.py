"""fetch_state (node/rounds/state_fetch.py): ranges into one buffer, a break resumed at the next
holder without fetching again what arrived, one state pinned across holders.

Holders here are StateServers (node/daemon/state_serving.py) answered in memory: a fake of the
transport's request only (its streams are tested in tests/integration/test_state_transfer.py).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from node.daemon.state_serving import StateServer
from node.rounds.state import StateLayout
from node.rounds.state_fetch import StateFetchFailed, download_bound_s, fetch_state
from p2p.errors import P2PError, TransferFailed
from p2p.limits import TransferLimits
from protocol.tensors import weights_digest
from tests.state_peer import FixedState


def holder(seed: int, round_index: int = 3) -> FixedState:
    g = torch.Generator().manual_seed(seed)
    phi = {"w": torch.randn(400, 300, generator=g), "b": torch.randn(300, generator=g)}
    return FixedState((round_index, {"phi": phi, "momentum": {n: t / 10 for n, t in phi.items()}},
                       weights_digest(phi)))


class Network:
    """request() answered by each peer's StateServer; a peer in `breaks` fails its n-th request
    (counting from 1) and every one after it, like a member that left."""

    def __init__(self, holders: dict[str, FixedState], breaks: dict[str, int] | None = None):
        self.servers = {peer: StateServer(h) for peer, h in holders.items()}
        self.breaks, self.asked = breaks or {}, []
        self.limits = SimpleNamespace(parallel_streams=4)

    async def request(self, peer, kind, round_index, *, meta, streams, expected_reply_bytes=0):
        self.asked.append((peer, meta["offset"], meta["length"]))
        if len([a for a in self.asked if a[0] == peer]) >= self.breaks.get(peer, 10 ** 9):
            raise TransferFailed(f"the stream from {peer} broke")
        request = SimpleNamespace(sender=b"joiner", meta=meta)
        reply = await self.servers[peer].respond(request)
        payload = b"".join(bytes(memoryview(t.data)) for t in reply.tensors)
        self.servers[peer].finished(request)  # what the transport says once the reply is sent
        return SimpleNamespace(meta=reply.meta, payload=memoryview(payload))


LAYOUT = StateLayout.of(holder(1).state[1]["phi"])


def test_a_break_resumes_at_the_next_holder_where_it_stopped():
    network = Network({"a": holder(1), "b": holder(1)}, breaks={"a": 3})
    fetched = asyncio.run(fetch_state(network, ["a", "b"], LAYOUT))
    chunk = LAYOUT.chunk_bytes()
    assert fetched.digest == holder(1).state[2] and fetched.sources == ["a", "b"]
    assert fetched.ranges[2] == ("b", 2 * chunk, 3 * chunk)  # b starts where a broke off
    received = [end - start for _, start, end in fetched.ranges]
    assert sum(received) == LAYOUT.total  # nothing fetched twice
    assert fetched.bytes_fetched == LAYOUT.total + chunk  # the range in flight, lost once
    assert torch.equal(fetched.groups["momentum"]["w"], holder(1).state[1]["momentum"]["w"])
    assert fetched.served_phi_alone() == "a"  # its ranges held all of φ (the first half)


def test_a_range_that_broke_counts_what_the_transport_read_of_it_not_its_whole_length():
    """A holder gone before a byte of its range came (the stream never opened) costs no bytes."""
    network = Network({"a": holder(1), "b": holder(1)}, breaks={"a": 3})
    network.counters = SimpleNamespace(bytes_received=0)  # the broken request read nothing
    fetched = asyncio.run(fetch_state(network, ["a", "b"], LAYOUT))
    assert fetched.bytes_fetched == LAYOUT.total


def test_a_holder_of_another_state_is_not_mixed_in():
    network = Network({"a": holder(1), "c": holder(2), "b": holder(1)}, breaks={"a": 2})
    fetched = asyncio.run(fetch_state(network, ["a", "c", "b"], LAYOUT))
    assert fetched.digest == holder(1).state[2] and fetched.sources == ["a", "b"]
    assert all(peer != "c" for peer, _, _ in fetched.ranges)
    assert fetched.served_phi_alone() is None  # φ from a and b: a wrong φ could blame neither


def test_when_no_holder_brings_a_byte_the_download_ends_with_every_reason():
    network = Network({"a": holder(1), "b": holder(1)}, breaks={"a": 1, "b": 1})
    with pytest.raises(StateFetchFailed) as failed:
        asyncio.run(fetch_state(network, ["a", "b"], LAYOUT))
    assert "stopped at 0 of" in str(failed.value)
    assert [peer for peer, _ in failed.value.errors] == ["a", "b"]
    assert all(isinstance(e, P2PError) for _, e in failed.value.errors)


def test_a_download_is_bounded_by_its_bytes_at_the_swarms_minimum_rate():
    limits = TransferLimits(min_rate_bytes_per_s=1e6, stall_s=2.0)
    chunk = LAYOUT.chunk_bytes()
    full, rest = divmod(LAYOUT.total, chunk)
    assert download_bound_s(LAYOUT, limits) == pytest.approx(
        (full + bool(rest)) * 2.0 + LAYOUT.total / 1e6)
