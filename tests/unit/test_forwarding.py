"""The forwarding member's parts (p2p/forwarding.py) on in-memory streams: the preamble, whom a
refusal blames, and the bounded copy."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID

from p2p.errors import Reason, Refusal
from p2p.forwarding import blamed, pipe, preamble, read_preamble
from p2p.identity import NodeIdentity

ORIGIN, FORWARDER = (NodeIdentity.generate().peer_id for _ in range(2))


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


class _Sink:
    """A StreamWriter's write/drain/close, keeping what was written."""

    def __init__(self):
        self.data, self.closed = bytearray(), False

    def write(self, chunk: bytes) -> None:
        self.data += chunk

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_preamble_names_a_peer_and_a_bad_one_is_refused_with_its_reason():
    async def read(data: bytes, eof: bool = True) -> PeerID:
        return await read_preamble(_reader(data, eof), timeout_s=0.2)
    assert asyncio.run(read(preamble(ORIGIN) + b"frames follow")) == ORIGIN
    for data, reason, words in ((b"\x00", Reason.MALFORMED, "names no peer"),
                                (b"\x41" + b"x" * 65, Reason.MALFORMED, "names no peer"),
                                (preamble(ORIGIN)[:10], Reason.TRUNCATED, "inside its forwarding preamble")):
        with pytest.raises(Refusal) as refused:
            asyncio.run(read(data))
        assert refused.value.reason == reason and words in refused.value.detail
    with pytest.raises(Refusal) as refused:
        asyncio.run(read(b"", eof=False))
    assert refused.value.reason == Reason.TIMEOUT


def test_what_a_forwarder_could_cause_counts_against_it_and_signed_content_against_the_origin():
    assert blamed(Reason.BAD_SIGNATURE, ORIGIN, None, False) == ORIGIN  # not forwarded
    for reason in (Reason.BAD_SIGNATURE, Reason.WRONG_SENDER, Reason.MALFORMED, Reason.TRUNCATED,
                   Reason.TIMEOUT, Reason.BUSY):
        assert blamed(reason, ORIGIN, FORWARDER, head_verified=False) == FORWARDER
    for reason in (Reason.BAD_DIGEST, Reason.REPLAYED, Reason.TIMEOUT, Reason.WRONG_RECIPIENT, Reason.EXPIRED):
        assert blamed(reason, ORIGIN, FORWARDER, head_verified=True) == FORWARDER  # garbled, replayed, stalled
    for reason in (Reason.TOO_LARGE, Reason.STALE_ROUND, Reason.WRONG_MANIFEST):
        assert blamed(reason, ORIGIN, FORWARDER, head_verified=True) == ORIGIN   # it signed that
        assert blamed(reason, ORIGIN, FORWARDER, head_verified=False) == FORWARDER


def test_the_copy_goes_both_ways_and_stops_at_its_byte_bound_and_on_a_stall():
    async def scenario():
        a_out, b_out = _Sink(), _Sink()
        copied = await pipe((_reader(b"a" * 1000), a_out), (_reader(b"b" * 300), b_out), chunk_bytes=64,
                            stall_s=1.0, max_bytes=10_000)
        assert copied == (1000, 300) and bytes(b_out.data) == b"a" * 1000 and bytes(a_out.data) == b"b" * 300
        assert a_out.closed and b_out.closed
        # a side that sends more than the bound is cut there
        big = await pipe((_reader(b"a" * 5000, eof=False), _Sink()), (_reader(b"", eof=False), _Sink()),
                         chunk_bytes=64, stall_s=0.3, max_bytes=1000)
        assert big[0] == 1000
        # a side that stalls ends the forwarding after its stall bound, with both closed
        stalled_a, stalled_b = _Sink(), _Sink()
        started = asyncio.get_running_loop().time()
        await pipe((_reader(b"", eof=False), stalled_a), (_reader(b"", eof=False), stalled_b), chunk_bytes=64,
                   stall_s=0.2, max_bytes=1000)
        assert asyncio.get_running_loop().time() - started < 3.0 and stalled_a.closed and stalled_b.closed
    asyncio.run(scenario())
