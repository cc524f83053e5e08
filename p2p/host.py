"""One node's hivemind P2P daemon (p2pd) and DHT node, both in the caller's event loop.

    identity = NodeIdentity.load_or_create(identity_path(data_dir))
    host = await P2PHost.start(identity, host_maddrs=["/ip4/0.0.0.0/tcp/31337"],
                               initial_peers=manifest.bootstrap_peers)
    ... Membership(host, ...), Transport(host.p2p, identity, ...) ...
    await host.shutdown()

Why not `hivemind.DHT`: it forks a process and blocks its caller until bootstrapped, which
deadlocks when the bootstrap peer lives in the same event loop (see notes/hivemind.md); here
`P2P.create` and `DHTNode.create(p2p=...)` run in the daemon's own (uv)loop. Port mapping
(UPnP/NAT-PMP) stays off unless asked for: it opens a UDP socket on 0.0.0.0. The identity check
of hivemind (`check_if_identity_free`) is off because it assumes RSA keys and crashes on ours.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import socket
import tempfile
import time
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from hivemind.dht import protocol as dht_protocol
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils.multiaddr import Multiaddr

from p2p.errors import HostError
from p2p.identity import NodeIdentity
from p2p.paths import for_p2pd
from p2p.reachability import (DIAL_BACK, DialBackService, Reachability, ReachabilityOptions, create_p2p,
                               find_reachability, p2pd_options, wait_for_relay_addresses)
from p2p.records import CLOCK_SKEW_TOLERANCE_S, STORE_SENDER, OwnerOnlyValidator

logger = logging.getLogger("lowcomm.p2p.host")
LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
SOCKET_GLOB = "/tmp/hivemind-*.sock"  # p2pd's and its clients' unix sockets (hivemind names them)
T = TypeVar("T")
# hivemind's DHT refuses to bootstrap from a peer whose clock differs from ours by more than 3 s
# ("local time must be within 3 seconds of others"): a volunteer a few seconds off could not
# join at all. Member records tolerate CLOCK_SKEW_TOLERANCE_S, and so does the bootstrap.
dht_protocol.MAX_DHT_TIME_DISCREPANCY_SECONDS = CLOCK_SKEW_TOLERANCE_S


def socket_paths() -> set[str]:
    """hivemind's unix sockets in /tmp now (live or left behind by a process that died)."""
    return set(glob.glob(SOCKET_GLOB))


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop where installed (10-20 % faster streams), else on asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def check_peer_maddrs(maddrs: Sequence[str], what: str = "initial peer") -> list[str]:
    """Each address must be a multiaddr ending in /p2p/<peer id>: the DHT pings peers by id."""
    checked = []
    for text in maddrs:
        try:
            maddr = Multiaddr(str(text))
            PeerID.from_base58(maddr["p2p"])
        except Exception:
            raise HostError(f"{what} {text!r} is not a multiaddr with a peer id, "
                            f"e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...") from None
        checked.append(str(maddr))
    return checked


class P2PHost:
    """The P2P daemon and the DHT node of one lowcomm node. Create with `await P2PHost.start(...)`."""

    def __init__(self, identity: NodeIdentity, p2p: P2P, dht: DHTNode, validator: OwnerOnlyValidator):
        self.identity, self.p2p, self.dht, self.validator = identity, p2p, dht, validator
        self.peer_id: PeerID = p2p.peer_id
        self.initial_peers: list[str] = []
        self.reachability = Reachability("local", "not checked")
        self._closed = False

    @classmethod
    async def start(cls, identity: NodeIdentity, *, host_maddrs: Sequence[str] = LOOPBACK_MADDRS,
                    announce_maddrs: Sequence[str] | None = None, initial_peers: Sequence[str] = (),
                    nat_port_map: bool = False, startup_timeout_s: float = 15.0, dht_wait_timeout_s: float = 3.0,
                    reachability: ReachabilityOptions | None = None, **dht_options: Any) -> "P2PHost":
        """Start p2pd under `identity` and a DHT node on it; bootstrap from `initial_peers`.

        `initial_peers` must be DHT nodes (full multiaddrs with /p2p/...); an empty list starts a
        new swarm. `reachability` (default: auto) decides whether p2pd runs as a public node
        (a relay for others) or behind NAT (reserving relay slots): p2p/reachability.py.
        `dht_options` go to `DHTNode.create` (e.g. num_replicas).
        """
        if identity.path is None:
            raise HostError("the identity has no key file; save it (NodeIdentity.save) before starting p2pd.")
        initial_peers = check_peer_maddrs(initial_peers)
        options, validator = reachability or ReachabilityOptions(), OwnerOnlyValidator(identity)
        base = {"identity_path": str(identity.path), "initial_peers": initial_peers or None,
                "nat_port_map": nat_port_map, "check_if_identity_free": False,
                "startup_timeout": startup_timeout_s}
        with tempfile.TemporaryDirectory(prefix="lowcomm-probe-") as scratch:
            # the probe runs under a throwaway key: our own peer id reconnecting right after the
            # probe left was followed by failed bootstraps (measured twice in the NAT testbed)
            probe_identity = NodeIdentity.generate()
            probe_identity.save(os.path.join(scratch, "probe.key"))
            found = await find_reachability(
                options, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs or (),
                initial_peers=initial_peers, stop_probe=shutdown_p2p,
                start_probe=lambda: start_p2pd(host_maddrs=list(host_maddrs),
                                               **{**base, "identity_path": str(probe_identity.path)}))
        create_options, flags, listen = p2pd_options(found.mode, options.relays or initial_peers, host_maddrs,
                                                     options.hole_punching)
        if found.mode == "private" and announce_maddrs:
            # p2pd's announce list replaces every address, relayed ones too; an address the
            # dial-back could not open is of no use to anyone
            found.dropped_announce = list(announce_maddrs)
            logger.warning("--announce %s is not reachable (%s): advertising relay addresses instead; "
                           "forward that port on your router to be dialled directly",
                           ", ".join(announce_maddrs), found.how)
            announce_maddrs = None
        p2p = await start_p2pd(host_maddrs=listen,
                                announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
                                extra_flags=flags,
                                **base, **create_options)
        try:
            if p2p.peer_id != identity.peer_id:
                raise HostError(f"p2pd runs as {p2p.peer_id} instead of {identity.peer_id}; "
                                f"is {identity.path} the key it was given?")
            dht = await DHTNode.create(p2p=p2p, initial_peers=initial_peers or None, record_validator=validator,
                                       wait_timeout=dht_wait_timeout_s, **dht_options)
            await _name_the_sender_of_dht_stores(p2p, dht)
            await p2p.add_binary_stream_handler(
                DIAL_BACK, DialBackService(found.mode == "public", options.dial_back_timeout_s).handle)
            if found.mode == "private" and create_options.get("trusted_relays"):
                found.relay_addrs = await wait_for_relay_addresses(p2p, options.relay_wait_s)
        except BaseException as error:
            await shutdown_p2p(p2p)
            if isinstance(error, HostError) or not isinstance(error, Exception):
                raise
            if "bootstrap failed" in str(error):
                raise HostError("none of the initial peers answered as a DHT node; check their addresses "
                                "and that they are running.") from None
            raise HostError(f"the DHT node did not start: {error}") from None
        host = cls(identity, p2p, dht, validator)
        host.initial_peers, host.reachability = initial_peers, found
        logger.info("p2p host %s listening on %s", host.peer_id, await host.maddrs())
        logger.info("reachability: %s", found.line())
        if found.mode == "private" and not found.relay_addrs:
            logger.warning("no bootstrap peer gave this node a relay slot within %.0f s: members behind "
                           "other NATs cannot reach it; check that a bootstrap peer is public and runs "
                           "this version", options.relay_wait_s)
        return host

    async def maddrs(self) -> list[str]:
        """Addresses other nodes can pass as initial peers (each ends in /p2p/<our id>)."""
        return [str(maddr) for maddr in await self.dht.get_visible_maddrs(latest=True)]

    async def reconnect(self, maddrs: Sequence[str], timeout_s: float = 10.0) -> int:
        """Dial each address (full multiaddrs with /p2p/...) and ping it as a DHT node, then look
        up our neighbours again; returns how many answered.

        For a node cut off from the swarm for longer than the DHT's timeouts: its routing table
        has dropped every peer by then and bootstrapping happens only at start, so without this
        it would stay alone after its link comes back.
        """
        answered = 0
        for text in dict.fromkeys(maddrs):  # unique, in order
            with suppress(Exception):
                maddr = Multiaddr(text)
                # the last /p2p/ names the peer: a relayed address names its relay first
                peer = PeerID.from_base58(text.rsplit("/p2p/", 1)[1])
                if peer == self.peer_id:
                    continue
                async with asyncio.timeout(timeout_s):
                    # hivemind has no public dial; p2pd takes the address without /p2p/<id>
                    await self.p2p._client.connect(peer, [for_p2pd(maddr.decapsulate(Multiaddr(f"/p2p/{peer}")))])
                    answered += await self.dht.protocol.call_ping(peer) is not None
        if answered:
            with suppress(Exception):
                async with asyncio.timeout(timeout_s):
                    await self.dht.find_nearest_nodes([self.dht.node_id])
        return answered

    def p2pd_lost(self) -> str | None:
        """How p2pd ended if it died under us (e.g. "killed by signal 9"); None while it runs
        or after our own shutdown."""
        child = getattr(self.p2p, "_child", None)
        code = None if child is None or self._closed else child.returncode
        if code is None:
            return None
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    async def shutdown(self) -> None:
        """Stop the DHT node and p2pd, and remove p2pd's unix sockets from /tmp. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with suppress(Exception):
            await asyncio.wait_for(self.dht.shutdown(), 5.0)
        await shutdown_p2p(self.p2p)


async def start_p2pd(extra_flags: dict | None = None, **create_options: Any) -> P2P:
    """p2pd, or a HostError of one sentence naming the cause and the fix."""
    initial_peers, startup_timeout_s = create_options["initial_peers"] or [], create_options["startup_timeout"]
    sockets_before = socket_paths()
    try:
        return await create_p2p(extra_flags, **create_options)
    except Exception as error:
        # hivemind does not return the half-started daemon, so its socket cannot be named:
        # remove the sockets that appeared meanwhile once nothing listens on them.
        await _remove_sockets_of_a_failed_start(socket_paths() - sockets_before)
        text = str(error).strip()
        if "failed to connect to bootstrap peers" in text:
            raise HostError(f"none of the bootstrap peers {', '.join(initial_peers)} answered: they are down "
                            f"or their addresses are wrong; check them with `lowcomm-node doctor`, or "
                            f"ask the swarm's operator for a live bootstrap peer.") from None
        if "failed to start in" in text:
            raise HostError(f"the P2P daemon (p2pd) did not start within {startup_timeout_s:.0f} s: the machine "
                            f"is overloaded or p2pd is blocked; retry, or give it longer with "
                            f"--p2pd-timeout.") from None
        raise HostError(f"the P2P daemon did not start ({text[:300]}).") from None


def _refuses_connections(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
        return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        probe.close()


def remove_dead_sockets(paths: set[str] | list[str]) -> list[str]:
    """Delete the unix sockets that nothing listens on any more; return those deleted.

    For cleaning up after a SIGKILLed node: a socket is dead when it refuses connections twice,
    100 ms apart (the second probe spares a daemon caught between bind() and listen()). Never
    delete sockets by name pattern alone: a test running beside yours owns some of them.
    """
    suspects = [path for path in paths if _refuses_connections(path)]
    if suspects:
        time.sleep(0.1)
    removed = []
    for path in suspects:
        if _refuses_connections(path):
            with suppress(FileNotFoundError):
                os.remove(path)
                removed.append(path)
    return removed


def _still_there(paths: set[str]) -> set[str]:
    """Removes those of `paths` that nothing listens on; returns those left."""
    remove_dead_sockets(paths)
    return {path for path in paths if os.path.exists(path)}


@contextmanager
def dead_sockets_removed(patience_s: float = 10.0) -> Iterator[None]:
    """Around processes that use hivemind and may leave their sockets in /tmp (its DHT's client
    sockets outlive a process that exits): removes, at the end, the sockets that appeared
    meanwhile once nothing listens on them, waiting at most `patience_s` for the processes
    still exiting (a time-to-loss run left 4 that were live at its end and dead a moment later)."""
    before = socket_paths()
    try:
        yield
    finally:
        deadline = time.monotonic() + patience_s
        while (left := _still_there(socket_paths() - before)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            logger.warning("%d sockets that appeared during the run still listen: left in place", len(left))


async def _remove_sockets_of_a_failed_start(paths: set[str], patience_s: float = 3.0) -> None:
    """A p2pd that failed to bootstrap reports it and exits a moment later: its socket still
    listens right after the report (measured: one left in /tmp per failed start). Retry until
    nothing listens on them, for at most `patience_s` (a socket that stays live belongs to a
    daemon running beside us, and stays)."""
    deadline = time.monotonic() + patience_s
    while (paths := _still_there(paths)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def p2pd_socket_paths(p2p: P2P) -> list[str]:
    """The unix sockets hivemind made for this daemon (private attributes, read defensively)."""
    paths = []
    for attribute in ("_daemon_listen_maddr", "_client_listen_maddr"):
        maddr = getattr(p2p, attribute, None)
        with suppress(Exception):
            paths.append(maddr["unix"])
    return paths


async def _name_the_sender_of_dht_stores(p2p: P2P, dht: DHTNode) -> None:
    """Re-registers hivemind's DHT store handler (hivemind's code, unchanged) inside a wrapper
    that sets records.STORE_SENDER while it runs: the validator then knows which peer sent a
    forged member record, and the daemon can ban it. hivemind's validator API sees only the
    record, and a forgery signed by nobody it names cannot be traced any other way."""
    protocol = dht.protocol
    name = protocol._get_handle_name(None, "rpc_store")

    async def rpc_store(request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        token = STORE_SENDER.set(context.remote_id.to_base58())
        try:
            return await protocol.rpc_store(request, context)
        finally:
            STORE_SENDER.reset(token)

    await p2p.remove_protobuf_handler(name)
    await p2p.add_protobuf_handler(name, rpc_store, dht_pb2.StoreRequest)


async def shutdown_p2p(p2p: P2P) -> None:
    # hivemind removes the daemon's socket only if p2pd was still running, and never waits
    # forever here: a p2pd that ignores SIGTERM for 5 s gets SIGKILL.
    sockets = p2pd_socket_paths(p2p)
    with suppress(Exception):
        await asyncio.wait_for(p2p.shutdown(), 5.0)
    child = getattr(p2p, "_child", None)
    if child is not None and child.returncode is None:
        with suppress(ProcessLookupError):
            child.kill()
        with suppress(Exception):
            await asyncio.wait_for(child.wait(), 5.0)
    for path in sockets:
        with suppress(FileNotFoundError):
            os.remove(path)
