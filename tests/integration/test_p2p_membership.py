"""Swarm membership on a real DHT of real p2pd processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hivemind.dht.validation import DHTRecord

from p2p.errors import HostError
from p2p.membership import Clocks, Membership, members_key
from p2p.records import SIGNED_MARKER, _record_signing_input
from tests.p2p_helpers import MANIFEST, read_line, run, wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def membership(host, ttl_s=30.0, **options):
    return Membership(host, "swarm-a", protocol="noloco", manifest=MANIFEST, ttl_s=ttl_s, **options)


class SteppedClock:
    """A reader's monotonic clock that the test moves (a fake for time itself, nothing else)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_three_nodes_discover_each_other(tmp_path, p2p_cleanup):
    """Discovery, bounded by a generous wait (how fast it is belongs to benchmarks: it takes
    well under 2 s on an idle machine, printed below)."""
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 3) as hosts:
            members = [membership(host) for host in hosts]
            started = time.monotonic()
            for member in members:
                await member.start()

            async def everyone_sees_everyone():
                views = [await member.peers() for member in members]
                return all(len(view) == 2 for view in views) and views
            views = await wait_until(everyone_sees_everyone, timeout_s=30.0, what="full discovery")
            elapsed = time.monotonic() - started
            ids = {host.peer_id.to_base58() for host in hosts}
            for host, view in zip(hosts, views):
                assert set(view) == ids - {host.peer_id.to_base58()}
                for record in view.values():
                    assert record.protocol == "noloco" and record.manifest == MANIFEST and record.status == "joining"
                    assert record.addrs and record.addrs[0].startswith("/ip4/127.0.0.1/")

            await members[1].update(round=7, status="ready", throughput=1234.5, extra={"phi": "ab12"})
            seen = (await members[0].peers())[hosts[1].peer_id.to_base58()]
            assert (seen.round, seen.status, seen.throughput, seen.extra) == (7, "ready", 1234.5, {"phi": "ab12"})
            for member in members:
                await member.stop()
            print(f"\n3-node discovery took {elapsed * 1000:.0f} ms")
    run(scenario(), timeout_s=60)


def test_graceful_leave_is_seen_at_once(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            member_a, member_b = membership(a), membership(b)
            await member_a.start()
            await member_b.start()
            await wait_until(lambda: _has(member_a, b), 2.0, what="b visible to a")
            started = time.monotonic()
            await member_b.leave()
            assert b.peer_id.to_base58() not in await member_a.peers()  # one read, no polling
            print(f"\nleave visible after {(time.monotonic() - started) * 1000:.0f} ms")
            await member_a.stop()
    run(scenario(), timeout_s=60)


def refusing_store(host, refusals: int):
    """Fault injection: the host's DHT answers its next `refusals` stores with False, as a DHT
    whose routing table is still filling does; later stores reach the real DHT."""
    real, left = host.dht.store, [refusals]

    async def store(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            return False
        return await real(*args, **kwargs)
    host.dht.store = store
    return left


def test_a_refused_first_store_is_retried_and_a_dead_dht_named(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 2) as (a, b):
            member_a = membership(a)
            await member_a.start()
            left = refusing_store(b, 2)
            member_b = membership(b)
            await member_b.start()  # two refusals, then stored
            assert left == [0]
            await wait_until(lambda: _has(member_a, b), 2.0, what="b visible to a after retries")
            await member_b.stop()
            refusing_store(b, 10**6)
            doomed = Membership(b, "swarm-b", protocol="noloco", manifest=MANIFEST, ttl_s=1.5)
            started = time.monotonic()
            with pytest.raises(HostError, match="within 2 s: check that the bootstrap peers"):
                await doomed.start()
            assert time.monotonic() - started <= 1.5 + 0.5  # bounded by one TTL
            await member_a.stop()
    run(scenario(), timeout_s=60)


def test_killed_node_disappears_within_its_ttl(tmp_path, p2p_cleanup):
    """A member SIGKILLed stays in a reader's view exactly `ttl_s` after the reader first saw its
    last heartbeat, by the reader's clock (stepped by the test: no window of wall-clock time).
    The victim's p2pd must still remove its socket once its client is killed (checked by the
    fixture); the client socket the killed process listened on is the fixture's to remove."""
    ttl_s = 2.0

    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 1) as (a,):
            stepped = SteppedClock()
            member_a = membership(a, ttl_s=ttl_s, clocks=Clocks(monotonic=stepped))
            await member_a.start()
            process = p2p_cleanup.track_process(subprocess.Popen(
                [sys.executable, "-m", "tests.p2p_helpers", "member", str(tmp_path / "victim"), "swarm-a",
                 str(ttl_s), (await a.maddrs())[0]],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            line = await read_line(process, timeout_s=30)
            victim = json.loads(line)
            p2p_cleanup.track_pid(victim["p2pd_pid"], victim["p2pd_sockets"])
            p2p_cleanup.track_killed(victim["own_sockets"])
            await wait_until(lambda: _has_id(member_a, victim["peer_id"]), 5.0, what="victim visible")

            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            assert await _has_id(member_a, victim["peer_id"])  # its last heartbeat, seen from now
            stepped.now += ttl_s - 0.01
            assert await _has_id(member_a, victim["peer_id"]), "the victim vanished before its TTL"
            stepped.now += 0.02
            assert await _lacks_id(member_a, victim["peer_id"]), "the victim outlived its TTL"
            await member_a.stop()
    run(scenario(), timeout_s=90)


def test_members_whose_clocks_differ_by_60_s_see_each_other_and_the_dead_vanish_by_the_readers_clock(
        tmp_path, p2p_cleanup):
    """b's clock runs 60 s behind a's, c's 60 s ahead: all three see each other (a writer 60 s
    behind stores records that the DHT nodes would otherwise drop as expired). When c stops
    beating, a drops it `ttl_s` after it first saw c's last heartbeat by a's own clock, although
    c's record, stamped by a clock 60 s ahead, stays in the DHT long after."""
    ttl_s = 10.0

    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 3) as (a, b, c):
            stepped = SteppedClock()
            member_a = membership(a, ttl_s=ttl_s, clocks=Clocks(monotonic=stepped))
            member_b = membership(b, ttl_s=ttl_s, clocks=Clocks(wall=lambda: time.time() - 60))
            member_c = membership(c, ttl_s=ttl_s, clocks=Clocks(wall=lambda: time.time() + 60))
            for member in (member_a, member_b, member_c):
                await member.start()
            ids = {host.peer_id.to_base58() for host in (a, b, c)}

            async def everyone_sees_everyone():
                views = [set(await member.peers()) for member in (member_a, member_b, member_c)]
                return all(len(view) == 2 for view in views)
            await wait_until(everyone_sees_everyone, timeout_s=5.0, what="discovery across skewed clocks")
            await member_c.stop()  # c dies: no heartbeat, no tombstone
            assert set(await member_a.peers()) == ids - {a.peer_id.to_base58()}
            stepped.now += ttl_s + 0.01
            await member_b.update(round=1)  # a new heartbeat of b, first seen from now
            assert set(await member_a.peers()) == {b.peer_id.to_base58()}
            for member in (member_a, member_b):
                await member.stop()
    run(scenario(), timeout_s=60)


def test_another_peer_cannot_write_our_subkey(tmp_path, p2p_cleanup):
    async def scenario():
        async with p2p_cleanup.hosts(tmp_path, 3) as (a, b, attacker):
            member_a, member_b = membership(a), membership(b)
            await member_a.start()
            await member_b.start()
            await member_a.update(round=3, status="training")
            key, victim = members_key("swarm-a"), a.peer_id.to_base58()
            key_id, serializer = _key_id(key), attacker.dht.protocol.serializer
            forged = dict(member_a.record.to_value(), round=999, status="ready", addrs=["/ip4/6.6.6.6/tcp/1"])
            body, expiration = serializer.dumps(forged), time.time() + 60

            def signed_by_attacker(subkey: str, exp: float) -> bytes:
                record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), body, exp)
                return body + attacker.identity.sign(_record_signing_input(record, body)) + SIGNED_MARKER
            genuine = a.dht.protocol.storage.get(key_id).value.get(victim)
            attacks = {
                "unsigned value for a's subkey": (victim, body, expiration),
                "a's subkey signed by the attacker": (victim, signed_by_attacker(victim, expiration), expiration),
                "a's genuine record replayed with a later expiry": (victim, genuine.value,
                                                                    genuine.expiration_time + 100),
                "fake member signed by the attacker": ("12D3KooWNotARealPeer", signed_by_attacker(
                    "12D3KooWNotARealPeer", expiration), expiration),
            }
            senders = {a: [], b: []}  # who each honest node's validator blames for a refused store
            for honest in (a, b):
                honest.validator.on_forgery = senders[honest].append
            for attack, (subkey, value, exp) in attacks.items():
                for honest in (a, b):  # a real store RPC on the DHT protocol, straight to each honest node
                    verdict = await attacker.dht.protocol.call_store(honest.peer_id, [key_id], [value], [exp],
                                                                     subkeys=[subkey])
                    assert verdict == [False], f"{attack}: {honest.peer_id} answered {verdict}"
            # every refused store is held against the peer that sent it (a replayed record with
            # a later expiry fails the signature too: the expiry is signed)
            for honest in (a, b):
                assert senders[honest] == [attacker.peer_id.to_base58()] * 4, senders[honest]
            await member_b.update(round=4)  # honest stores are not blamed on anyone
            assert all(len(found) == 4 for found in senders.values())

            for honest in (a, b):
                local = honest.dht.protocol.storage.get(_key_id(key))
                entries = dict(local.value.items())
                assert set(entries) <= {victim, b.peer_id.to_base58()}
                for entry in entries.values():
                    assert b"6.6.6.6" not in entry.value
            view = await member_b.peers(include_self=True)
            assert set(view) == {victim, b.peer_id.to_base58()}
            assert (view[victim].round, view[victim].status) == (3, "training")
            assert view[victim].addrs == member_a.record.addrs
            await member_a.stop()
            await member_b.stop()
    run(scenario(), timeout_s=60)


def _key_id(key: str):
    from hivemind.dht.routing import DHTID
    return DHTID.generate(source=key)


async def _has(member, host):
    return host.peer_id.to_base58() in await member.peers()


async def _has_id(member, peer_id):
    return peer_id in await member.peers()


async def _lacks_id(member, peer_id):
    return peer_id not in await member.peers()
