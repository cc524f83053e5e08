"""The state server (node/daemon/state_serving.py): one shared export a round, replies that view
it (no copy per request), one request in flight per peer, ranges that decode to the state.

The handler is the one `serve_state` registers with the node's transport; the transport itself
is left out (its streams are tested in tests/integration/): these tests look at what the handler
hands the transport to send.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from node.daemon import state_serving
from node.daemon.run import serve_state
from node.rounds.state import STATE_KIND, StateExport, StateLayout
from p2p.errors import Reason, Refusal
from protocol.tensors import weights_digest


class Policy:
    """A round policy's export as NoLoCo makes it: a fresh copy of φ and momentum each call."""

    def __init__(self, round_index: int = 4):
        g = torch.Generator().manual_seed(0)
        self.phi = {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g)}
        self.round = round_index
        self.exports = 0
        self.lock = threading.Lock()

    def state_version(self, round_index=None):
        return self.round, weights_digest(self.phi)

    def export_state(self, round_index=None):
        with self.lock:
            self.exports += 1
        copy = {n: t.clone() for n, t in self.phi.items()}
        return self.round, {"phi": copy, "momentum": {n: t / 10 for n, t in copy.items()}}, \
            weights_digest(self.phi)


def handler(policy: Policy):
    """The reply handler serve_state registers for STATE_KIND (called on the event loop), with
    `respond.finished(peer)`: what the transport says once a request's exchange is over."""
    handlers = {}

    def on_request(kind, respond, accept_round, finished):
        async def served(request):
            return await respond(request)
        served.finished = lambda peer: finished(header(peer))
        served.server = respond.__self__
        handlers[kind] = served
    transport = SimpleNamespace(on_request=on_request,
                                counters=SimpleNamespace(counted_reply=lambda respond: respond))
    serve_state(SimpleNamespace(loop=asyncio.get_running_loop(), network=SimpleNamespace(transport=transport), worker=None), policy)
    return handlers[STATE_KIND]


def header(peer: bytes, **meta):
    return SimpleNamespace(sender=peer, meta=dict(meta), kind=STATE_KIND)


def payload_arrays(message) -> list[np.ndarray]:
    return [np.asarray(t.data) for t in message.tensors]


def test_four_concurrent_requests_share_one_export_and_copy_nothing():
    policy = Policy()

    async def four():
        respond = handler(policy)
        return await asyncio.gather(*(respond(header(bytes([i]), offset=0, length=1 << 30))
                                      for i in range(4)))
    replies = asyncio.run(four())
    assert policy.exports == 1, f"{policy.exports} exports for 4 concurrent requests of one round"
    first = payload_arrays(replies[0])
    for reply in replies[1:]:
        for a, b in zip(first, payload_arrays(reply)):
            assert np.shares_memory(a, b), "a reply holds its own copy of the state"
    total = 8 * sum(t.numel() for t in policy.phi.values())
    assert sum(a.nbytes for a in first) == total == replies[0].meta["total"]


def test_ranges_view_the_export_and_decode_to_the_state():
    policy = Policy()
    state_round, groups, digest = policy.export_state()
    export = StateExport.of(state_round, groups, digest)
    layout = StateLayout.of(policy.phi)
    assert layout.total == export.total
    buffer = torch.empty(layout.total, dtype=torch.uint8)
    step = 7916  # ranges that cut tensors at any element
    for offset in range(0, export.total, step):
        parts = export.chunk(offset, step)
        largest = max(t.numel() for t in policy.phi.values())
        for part in parts:
            assert any(np.shares_memory(part.data, t.data) for t in export.tensors)
            assert part.dtype == "float32" and part.shape[0] <= largest  # within the wire's limits
        joined = b"".join(bytes(memoryview(p.data)) for p in parts)
        buffer[offset:offset + len(joined)] = torch.frombuffer(bytearray(joined), dtype=torch.uint8)
    decoded, got = layout.decode(buffer)
    assert got == digest
    for group in ("phi", "momentum"):
        for name, tensor in groups[group].items():
            assert torch.equal(decoded[group][name], tensor)


def test_a_second_request_of_a_peer_is_refused_busy_until_its_first_exchange_is_over(monkeypatch):
    monkeypatch.setattr(state_serving, "BUSY_WAIT_S", 0.0)  # refused at once, not after a wait
    policy = Policy()

    async def scenario():
        respond = handler(policy)
        reply = await respond(header(b"a", offset=0, length=1000))
        with pytest.raises(Refusal) as busy:
            await respond(header(b"a", offset=1000, length=1000))
        assert busy.value.reason is Reason.BUSY and "still sending" in busy.value.detail
        other = await respond(header(b"b", offset=0, length=1000))  # another peer is served
        del other
        gc.collect()  # a reply let go is not the exchange over: the slot stays taken
        with pytest.raises(Refusal):
            await respond(header(b"a", offset=1000, length=1000))
        respond.finished(b"a")
        again = await respond(header(b"a", offset=1000, length=1000))
        assert again.meta["offset"] == 1000
    asyncio.run(scenario())


def test_a_peers_next_range_waits_for_its_previous_exchange_to_be_over():
    """The downloader's next request often comes while our reply's last status is exchanged."""
    policy = Policy()

    async def scenario():
        respond = handler(policy)
        replies = [await respond(header(b"a", offset=0, length=1000))]
        waiting = asyncio.ensure_future(respond(header(b"a", offset=1000, length=1000)))
        await asyncio.sleep(0)  # it waits for the slot
        assert not waiting.done()
        respond.finished(b"a")  # the transport: the first exchange is over
        assert (await asyncio.wait_for(waiting, 30)).meta["offset"] == 1000
    asyncio.run(scenario())


def test_bad_ranges_and_another_digest_are_refused_with_a_reason():
    policy = Policy()

    async def scenario():
        respond = handler(policy)
        for meta, reason, words in [({"offset": -4, "length": 12}, Reason.MALFORMED, "outside"),
                                    ({"offset": 4 * 10 ** 12, "length": 12}, Reason.MALFORMED, "outside"),
                                    ({"offset": 0, "length": 0}, Reason.MALFORMED, "positive"),
                                    ({"offset": 2, "length": 8}, Reason.MALFORMED, "multiples of 4"),
                                    ({"offset": 0, "length": 12, "phi": "ab" * 16}, Reason.REFUSED,
                                     "not abababababab")]:
            with pytest.raises(Refusal) as refused:
                await respond(header(b"c", **meta))
            assert refused.value.reason is reason and words in refused.value.detail, refused.value.detail
    asyncio.run(scenario())


def test_a_newer_round_is_exported_once_and_the_older_export_goes_with_its_last_reply():
    policy = Policy()

    async def scenario():
        respond = handler(policy)
        old = await respond(header(b"a", offset=0, length=100))
        digest_4 = old.meta["phi"]
        policy.round, policy.phi = 5, {n: t + 1 for n, t in policy.phi.items()}
        new = await respond(header(b"b", offset=0, length=100))
        assert (old.meta["phi_round"], new.meta["phi_round"]) == (4, 5)
        assert policy.exports == 2
        # a's download of round 4 goes on after the round: its export is pinned
        del old
        respond.finished(b"a")
        gc.collect()
        still = await respond(header(b"a", offset=100, length=100, phi_round=4, phi=digest_4))
        assert policy.exports == 2 and still.meta["phi"] == digest_4
        size = still.meta["total"]
        last = await respond(header(b"c", offset=size - 12, length=100, phi_round=4, phi=digest_4))
        assert len(last.tensors) == 1 and last.tensors[0].shape == (3,)  # three fp32 elements
        del still, last
        respond.finished(b"a"), respond.finished(b"c")
        policy.round, policy.phi = 6, {n: t + 1 for n, t in policy.phi.items()}
        for peer in (b"d", b"e", b"f"):  # three more downloads of newer rounds
            await respond(header(peer, offset=0, length=100))
            policy.round, policy.phi = policy.round + 1, {n: t + 1 for n, t in policy.phi.items()}
        gc.collect()
        with pytest.raises(Refusal) as gone:  # beyond PINNED_OLDER, the oldest pin went
            await respond(header(b"a", offset=200, length=100, phi_round=4, phi=digest_4))
        assert gone.value.reason is Reason.REFUSED
    asyncio.run(scenario())


def test_a_sketch_is_the_states_values_at_the_seeds_elements_and_finds_bytes_that_differ():
    """A sketch reply holds the export's values at `sketch_indices(seed)` (a sample of a state
    larger than the count; every element of a smaller one); a downloaded range that differs
    where the sketch sampled it is counted; a malformed sketch request is refused in a sentence."""
    from node.rounds.state import sketch_indices
    from node.rounds.state_fetch import FetchedState, StateSketch
    policy = Policy()
    state_round, groups, digest = policy.export_state()
    layout = StateLayout.of(policy.phi)
    flat = torch.cat([t.reshape(-1) for g in ("phi", "momentum") for _, t in sorted(groups[g].items())])

    async def ask(**meta):
        return await handler(policy)(header(b"p", **meta))
    for count in (1000, 1 << 16):
        reply = asyncio.run(ask(sketch=7, count=count))
        indices = sketch_indices(7, layout.total // 4, count)
        largest = max(t.numel() for t in policy.phi.values())
        assert all(t.shape[0] <= largest for t in reply.tensors)  # within the swarm's wire limits
        values = np.concatenate([np.asarray(t.data) for t in reply.tensors])
        assert len(values) == min(count, layout.total // 4) and reply.meta["phi"] == digest
        assert np.array_equal(values, flat.numpy()[indices])
    sketch = StateSketch("p", reply.meta, indices, values, layout.total // 8)
    assert abs(sketch.phi_norm() - float(policy.phi["w"].norm().hypot(policy.phi["b"].norm()))) < 1e-3
    buffer = torch.frombuffer(bytearray(flat.numpy().tobytes()), dtype=torch.uint8)
    fetched = FetchedState({}, digest, {}, buffer=buffer, held=layout.total)
    assert sketch.mismatches(fetched, 0, layout.total) == 0
    flat_view = buffer.numpy().view(np.float32)
    flat_view[100] += 1.0   # one value of the first range changed
    assert sketch.mismatches(fetched, 0, 4096) == 1 and sketch.mismatches(fetched, 4096, layout.total) == 0
    for bad in ({"sketch": -1, "count": 10}, {"sketch": 1, "count": 0}, {"sketch": 1, "count": 1 << 20},
                {"sketch": "x", "count": 10}):
        with pytest.raises(Refusal) as refused:
            asyncio.run(ask(**bad))
        assert refused.value.reason == Reason.MALFORMED and "sketch request" in str(refused.value)


def test_a_sketch_pins_the_export_for_its_peer_and_a_release_lets_it_go():
    """A member asked only for a sketch keeps that round's export for the asker (a download may
    follow, however many rounds later) until the asker releases it."""
    policy = Policy()

    async def scenario():
        respond = handler(policy)
        await respond(header(b"j", sketch=1, count=10))
        respond.finished(b"j")
        server = state_serving_of(respond)
        pinned = dict(server._pinned)
        released = await respond(header(b"j", release=True))
        return pinned, dict(server._pinned), released
    pinned, after, released = asyncio.run(scenario())
    assert list(pinned) == [b"j"] and after == {} and released.meta == {"released": True}


def state_serving_of(respond) -> state_serving.StateServer:
    server = getattr(respond, "server", None)
    assert isinstance(server, state_serving.StateServer), respond
    return server
