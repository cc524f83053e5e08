"""p2p/reachability.py and p2p/paths.py without p2pd: the flags each verdict gives p2pd, the
verdict from dial-back answers, the dial-back service on real loopback sockets, the relay's
limits. The same code behind real NAT routers: tests/integration/test_nat.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hivemind.utils.multiaddr import Multiaddr

from p2p.paths import GiB, PathCounts, RelayLimits, for_p2pd, relay_of
from p2p.reachability import (DialBackAnswer, DialBackService, NoPublicMember, ReachabilityOptions,
                              _verdict, is_loopback_only, listening_ports, p2pd_options, relay_maddrs)

RELAY = "12D3KooWGgwjaCo56fbPQTMepKayJA6Rg5ML7gVExZ7uNRm4hcV4"
HOME = "12D3KooWEY7cSn6GNrpVZgVxd6XnEuoXBfKM4GcSx6UqkS4DNc8g"


def test_private_nodes_reserve_one_address_per_relay_listen_on_quic_and_never_relay():
    peers = [f"/ip4/11.22.0.10/tcp/4001/p2p/{RELAY}", f"/ip4/11.22.0.10/udp/4001/quic-v1/p2p/{RELAY}",
             f"/ip4/11.22.0.10/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{HOME}"]
    options, flags, listen = p2pd_options("private", peers, ["/ip4/0.0.0.0/tcp/0"], hole_punching=True)
    assert options["force_reachability"] == "private" and options["use_auto_relay"]
    assert options["trusted_relays"] == [peers[0]]
    assert flags == {"relayDiscovery": 0, "relayService": 0}
    assert listen == ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
    assert p2pd_options("private", peers, ["/ip4/0.0.0.0/tcp/0"], hole_punching=False)[2] == ["/ip4/0.0.0.0/tcp/0"]
    options, flags, _ = p2pd_options("public", peers, ["/ip4/0.0.0.0/tcp/0"], hole_punching=True)
    assert options["force_reachability"] == "public" and flags == {"relayService": 1}
    assert p2pd_options("local", peers, ["/ip4/127.0.0.1/tcp/0"], hole_punching=True)[:2] == ({}, {})
    assert relay_maddrs(peers) == [peers[0]]
    # nobody to reserve a slot on (a private node that starts a swarm): no auto-relay at all
    options, flags, _ = p2pd_options("private", [], ["/ip4/0.0.0.0/tcp/0"], hole_punching=True)
    assert "use_auto_relay" not in options and flags == {"relayService": 0}


def test_the_verdict_follows_the_dial_back_answers():
    opened = DialBackAnswer(RELAY, "11.22.0.11", [4001], True)
    assert _verdict([opened], [4001]).mode == "public"
    closed = DialBackAnswer(RELAY, "11.22.0.100", [], True)
    found = _verdict([closed], [4001])
    assert found.mode == "private" and "could not open 11.22.0.100 on port(s) 4001" in found.how
    assert "no relay slot yet" in found.line()
    found.relay_addrs = [f"/ip4/11.22.0.10/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{HOME}",
                         f"/ip4/11.22.0.10/udp/4001/quic-v1/p2p/{RELAY}/p2p-circuit/p2p/{HOME}"]
    assert found.relays() == [RELAY] and found.line().endswith("reachable through 1 relay(s)")
    assert _verdict([], [4001]).mode == "private"
    with pytest.raises(NoPublicMember, match="a swarm needs at least one public member"):
        _verdict([DialBackAnswer(HOME, "11.22.0.100", [], False)], [4001])
    # a private peer that could dial us shares our LAN, at best: it proves nothing
    with pytest.raises(NoPublicMember):
        _verdict([DialBackAnswer(HOME, "192.168.1.2", [4001], False)], [4001])
    assert _verdict([DialBackAnswer(HOME, "192.168.1.2", [4001], False), closed], [4001]).mode == "private"


def test_addresses_and_options_are_checked():
    assert is_loopback_only(["/ip4/127.0.0.1/tcp/0"]) and not is_loopback_only(["/ip4/0.0.0.0/tcp/0"])
    assert listening_ports(["/ip4/127.0.0.1/tcp/5/p2p/" + RELAY, "/ip4/192.168.1.2/tcp/7/p2p/" + RELAY,
                            f"/ip4/11.22.0.10/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{HOME}"]) == [7]
    with pytest.raises(ValueError, match="reachability 'open' is unknown: use one of auto, public, private"):
        ReachabilityOptions("open")


def test_relay_limits_refuse_what_the_relay_would_cut_and_paths_are_counted():
    limits = RelayLimits()
    assert limits.refusal(64 * 1024) is None
    assert "2.0 MB would cross a circuit relay, which may cut a connection after 128 KiB (we send at most " \
        "64 KiB that way)" in limits.refusal(2 * 10**6)
    assert "4.00 GiB would cross" in limits.refusal(4 * GiB)
    counts = PathCounts()
    relayed = f"/ip4/11.22.0.10/tcp/4001/p2p/{RELAY}/p2p-circuit"
    assert counts.note(HOME, relayed) is True
    assert counts.note(RELAY, "/ip4/11.22.0.10/tcp/4001") is False
    counts.note_forwarded(HOME)
    assert counts.snapshot()["relayed_by_peer"] == {HOME: 1} and (counts.direct, counts.relayed) == (1, 1)
    assert counts.snapshot()["forwarded_by_peer"] == {HOME: 1} and counts.forwarded == 1
    # the relay a relayed address goes through: the one a forwarded stream is opened to
    assert relay_of(relayed) == RELAY and relay_of(relayed + f"/p2p/{HOME}") == RELAY
    assert relay_of("/ip4/11.22.0.10/tcp/4001") is None


def _ask(service: DialBackService, addr: str, request: bytes) -> dict:
    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data(request)
        reader.feed_eof()
        return await service._answer(SimpleNamespace(addr=Multiaddr(addr), peer_id=HOME), reader)
    return asyncio.run(scenario())


def test_dial_back_dials_only_the_observed_address_and_refuses_bad_requests():
    async def scenario():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port = server.sockets[0].getsockname()[1]
        service = DialBackService(public=True, timeout_s=1.0)
        reader = asyncio.StreamReader()
        reader.feed_data(json.dumps({"ports": [open_port, 9]}).encode() + b"\n")
        reader.feed_eof()
        answer = await service._answer(SimpleNamespace(addr=Multiaddr("/ip4/127.0.0.1/tcp/1"), peer_id=HOME), reader)
        server.close()
        return open_port, answer
    open_port, answer = asyncio.run(scenario())
    assert answer["observed"] == "127.0.0.1" and answer["reachable"] == [open_port] and answer["public"]
    service = DialBackService(public=False)
    assert "list of integers" in _ask(service, "/ip4/127.0.0.1/tcp/1", b'{"ports": ["x"]}\n')["error"]
    assert "longer than" in _ask(service, "/ip4/127.0.0.1/tcp/1", b"[" * 600 + b"\n")["error"]
    relayed = _ask(service, f"/ip4/11.22.0.10/tcp/4001/p2p/{RELAY}/p2p-circuit", b'{"ports": [1]}\n')
    assert "relayed" in relayed["error"] and relayed["public"] is False


def test_relayed_addresses_are_encoded_as_p2pd_decodes_them():
    text = f"/ip4/11.22.0.10/udp/4001/quic-v1/p2p/{RELAY}/p2p-circuit"
    raw = for_p2pd(text).to_bytes()
    multihash = bytes.fromhex("0024080112")  # identity multihash of an Ed25519 public key
    assert multihash in raw and b"\x01\x72" + multihash not in raw  # no CID prefix
    assert str(Multiaddr(raw)) == text
