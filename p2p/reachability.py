"""Whether other nodes can dial this one, and how p2pd is set up for it (public, or behind NAT).

A node learns its reachability at start by asking a bootstrap peer to dial it back
(`DIAL_BACK`): the peer opens plain TCP connections to the address it sees our connection come
from, on our listening ports. A home router drops them, a public host or a forwarded port
accepts them. The verdict sets p2pd's flags (notes/containers-and-nat.md, measured):

- public: forced public, so that p2pd serves as a circuit-relay v2 hop for members behind NAT;
- private: forced private, auto-relay reserving a slot through the public bootstrap peers
  (exactly one multiaddr per relay, `-relayDiscovery=0`), and `-relayService=0`: the swarm
  never depends on a home node to relay. DCUtR (hole punching) stays on in p2pd (`-autonat`)
  and punches a TCP hole between two homes once four public peers have seen each home's
  address (go-libp2p makes an observed address its own after four observers). They see one
  address because p2pd dials out from its listening port (SO_REUSEPORT, libp2p's default: with
  it off no address ever became the home's and no hole was punched, measured); the transport
  gives DCUtR another relayed connection to punch on (p2p/streams.py `_punch_again`);
- local: every listen address is loopback; nobody off this machine can dial it anyway, and
  p2pd keeps hivemind's defaults (the loopback tests and the local swarm).

hivemind's `P2P.create` does not expose `-relayDiscovery` and `-relayService`;
`_P2PWithFlags` adds them where hivemind builds p2pd's command line.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p.errors import HostError
from p2p.paths import is_relayed

logger = logging.getLogger("lowcomm.p2p.reachability")
DIAL_BACK = "lowcomm.dialback/1"
MODES = ("auto", "public", "private")
_MAX_REQUEST = 512
_MAX_PORTS = 4
_extra_flags: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("p2pd_flags", default={})


@dataclass(frozen=True)
class ReachabilityOptions:
    """How a node finds and uses its reachability (join's --reachability and --relay)."""

    mode: str = "auto"                 # auto: ask a bootstrap peer; public/private: trust the user
    relays: tuple[str, ...] = ()       # relays to reserve slots on; default: the initial peers
    # Listen on QUIC too, so that DCUtR can punch UDP holes as well. Off: DCUtR punches TCP
    # holes without it (measured, benchmarks/NOTEBOOK.md), and over QUIC hivemind's p2pd once
    # dropped incoming streams (loopback, 4 of 6 rounds of 16 MB; 6 of 6 passed on 2026-11-27).
    hole_punching: bool = False
    dial_back_timeout_s: float = 3.0   # per port, on the peer that dials us back
    relay_wait_s: float = 30.0         # a private node waits this long for a relay slot at start

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"reachability {self.mode!r} is unknown: use one of {', '.join(MODES)}.")


@dataclass
class Reachability:
    """A node's reachability as it was found; `line()` is what status and the log show."""

    mode: str                      # "public", "private" or "local"
    how: str                       # why we think so, one clause
    relay_addrs: list[str] = field(default_factory=list)   # our /p2p-circuit addresses
    dropped_announce: list[str] = field(default_factory=list)

    def line(self) -> str:
        if self.mode == "private":
            relays = (f"reachable through {len(self.relays())} relay(s)" if self.relay_addrs
                      else "no relay slot yet: only public members can reach it")
            return f"behind NAT ({self.how}); {relays}"
        return f"{self.mode} ({self.how})"

    def relays(self) -> list[str]:
        """The peer ids of the relays holding a slot for us (an address names its relay first)."""
        return list(dict.fromkeys(a.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1] for a in self.relay_addrs))

    def to_dict(self) -> dict:
        return {"mode": self.mode, "how": self.how, "relay_addrs": list(self.relay_addrs),
                "line": self.line()}


class _P2PWithFlags(P2P):
    """hivemind's P2P with p2pd flags it does not expose (set per start through a ContextVar)."""

    def _make_process_args(self, *args: Any, **kwargs: Any) -> list[str]:
        return P2P._make_process_args(*args, **{**kwargs, **_extra_flags.get()})


async def create_p2p(extra_flags: dict[str, Any] | None = None, **create_options: Any) -> P2P:
    """hivemind's P2P.create, with `extra_flags` for p2pd."""
    token = _extra_flags.set(dict(extra_flags or {}))
    try:
        return await _P2PWithFlags.create(**create_options)
    finally:
        _extra_flags.reset(token)


def is_loopback_only(maddrs: Sequence[str]) -> bool:
    hosts = [_host_of(Multiaddr(str(m))) for m in maddrs]
    return bool(hosts) and all(h is not None and ipaddress.ip_address(h).is_loopback for h in hosts)


def _host_of(maddr: Multiaddr) -> str | None:
    for protocol in ("ip4", "ip6"):
        try:
            return maddr[protocol]
        except Exception:
            continue
    return None


def relay_maddrs(peers: Sequence[str]) -> list[str]:
    """One direct multiaddr per relay peer: p2pd's auto-relay failed with several (measured)."""
    chosen: dict[str, str] = {}
    for text in peers:
        if is_relayed(text):
            continue
        peer = Multiaddr(text)["p2p"]
        chosen.setdefault(peer, text)
    return list(chosen.values())


def _with_quic(host_maddrs: Sequence[str]) -> list[str]:
    """The listen addresses plus a QUIC one per TCP one, for UDP hole punching; a home learns its
    QUIC address only from public peers it reached over QUIC."""
    listen = list(host_maddrs)
    for text in host_maddrs:
        host = _host_of(Multiaddr(text))
        if host is not None and "/tcp/" in text:
            quic = f"/{'ip6' if ':' in host else 'ip4'}/{host}/udp/0/quic-v1"
            if quic not in listen:
                listen.append(quic)
    return listen


def p2pd_options(mode: str, relays: Sequence[str], host_maddrs: Sequence[str],
                 hole_punching: bool) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(P2P.create options, extra p2pd flags, listen addresses) for a node found `mode`."""
    listen = _with_quic(host_maddrs) if hole_punching and mode != "local" else list(host_maddrs)
    if mode == "public":
        return {"force_reachability": "public", "use_relay": True}, {"relayService": 1}, listen
    if mode == "private":
        trusted = relay_maddrs(relays)
        if not trusted:  # p2pd panics on auto-relay with neither static relays nor discovery
            return {"force_reachability": "private", "use_relay": True}, {"relayService": 0}, listen
        options = {"force_reachability": "private", "use_relay": True, "use_auto_relay": True,
                   "trusted_relays": trusted}
        return options, {"relayDiscovery": 0, "relayService": 0}, listen
    return {}, {}, listen


# ---------------------------------------------------------------------- dial-back
@dataclass
class DialBackAnswer:
    peer: str
    observed: str | None     # our address as the peer saw it
    reachable: list[int]     # the ports it could open
    peer_public: bool        # whether the answering peer is public itself
    error: str | None = None
    clock_offset_s: float | None = None  # the peer's clock minus ours (mid-round-trip estimate)


class DialBackService:
    """Serves DIAL_BACK: dials the requester's observed address (never another) on at most
    `_MAX_PORTS` ports, a few requests at a time, each bounded by `timeout_s`."""

    def __init__(self, public: bool, timeout_s: float = 3.0, concurrent: int = 4):
        self.public, self.timeout_s = public, timeout_s
        self._slots = asyncio.Semaphore(concurrent)
        self.served = 0

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.timeout_s * _MAX_PORTS + 5):
                answer = await self._answer(info, reader)
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except Exception as error:  # a bad or slow requester: its stream closes, we go on
            logger.debug("dial-back request from %s failed: %s", getattr(info, "peer_id", "?"), error)
        finally:
            writer.close()

    async def _answer(self, info: Any, reader: asyncio.StreamReader) -> dict:
        line = await reader.readline()
        if len(line) > _MAX_REQUEST:
            return {"error": f"request longer than {_MAX_REQUEST} bytes"}
        ports = json.loads(line or b"{}").get("ports", [])
        if not (isinstance(ports, list) and all(isinstance(p, int) and 0 < p < 65536 for p in ports)):
            return {"error": "ports must be a list of integers 1-65535"}
        if is_relayed(info.addr):
            return {"error": "your connection to me is relayed: I cannot see your address", "public": self.public}
        observed = _host_of(info.addr)
        if observed is None:
            return {"error": f"cannot dial back over {info.addr}", "public": self.public}
        async with self._slots:
            results = await asyncio.gather(*(self._dial(observed, port) for port in ports[:_MAX_PORTS]))
        self.served += 1
        return {"observed": observed, "reachable": [p for p, ok in zip(ports, results) if ok],
                "public": self.public, "time": time.time()}

    async def _dial(self, host: str, port: int) -> bool:
        try:
            async with asyncio.timeout(self.timeout_s):
                _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return True
        except (OSError, TimeoutError):
            return False


async def ask_dial_back(p2p: P2P, peer: PeerID, ports: Sequence[int], timeout_s: float) -> DialBackAnswer:
    """Ask `peer` to dial us back on `ports`; raises on no answer."""
    async with asyncio.timeout(timeout_s * _MAX_PORTS + 10):
        _, reader, writer = await p2p.call_binary_stream_handler(peer, DIAL_BACK)
        try:
            sent = time.time()
            writer.write(json.dumps({"ports": list(ports)[:_MAX_PORTS]}).encode() + b"\n")
            await writer.drain()
            reply = json.loads(await reader.readline() or b"{}")
            received = time.time()
        finally:
            writer.close()
    # the peer stamps its reply after dialling: with ports, the midpoint estimate is off by up to
    # the dial time, so only a port-less request measures the clock
    if not reply:  # the stream closed without an answer: no verdict from this peer
        raise ConnectionError(f"peer {peer} closed the reachability check without an answer")
    offset = reply["time"] - (sent + received) / 2 if isinstance(reply.get("time"), (int, float)) else None
    return DialBackAnswer(peer.to_base58(), reply.get("observed"), list(reply.get("reachable", [])),
                          bool(reply.get("public")), reply.get("error"), offset)


def listening_ports(maddrs: Sequence[Multiaddr | str]) -> list[int]:
    """The TCP ports of our own non-loopback, non-relayed addresses."""
    ports = []
    for text in maddrs:
        maddr = Multiaddr(str(text))
        host = _host_of(maddr)
        if is_relayed(text) or host is None or ipaddress.ip_address(host).is_loopback:
            continue
        try:
            port = int(maddr["tcp"])
        except Exception:
            continue
        if port not in ports:
            ports.append(port)
    return ports


async def relay_addresses(p2p: P2P) -> list[str]:
    """Our /p2p-circuit addresses as p2pd advertises them right now."""
    return [str(m) for m in await p2p.get_visible_maddrs(latest=True) if is_relayed(m)]


async def wait_for_relay_addresses(p2p: P2P, timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """Waits (bounded) until p2pd holds a relay reservation; [] if none came."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found = await relay_addresses(p2p)
        if found or loop.time() >= deadline:
            return found
        await asyncio.sleep(poll_s)


async def find_reachability(options: ReachabilityOptions, *, host_maddrs: Sequence[str],
                            announce_maddrs: Sequence[str], initial_peers: Sequence[str],
                            start_probe: Callable[[], Awaitable[P2P]],
                            stop_probe: Callable[[P2P], Awaitable[None]]) -> Reachability:
    """Decides how p2pd starts. In `auto` mode with initial peers, a short-lived probe p2pd
    (`start_probe`, same identity and listen addresses) asks them to dial it back."""
    if options.mode != "auto":
        return Reachability(options.mode, "set by --reachability")
    if is_loopback_only(host_maddrs):
        return Reachability("local", "listening on loopback only")
    if not initial_peers:
        return Reachability("public", "assumed: it starts the swarm, so the others dial it first")
    probe = await start_probe()
    try:
        ports = listening_ports(announce_maddrs) or listening_ports(await probe.get_visible_maddrs(latest=True))
        answers = []
        for peer in dict.fromkeys(Multiaddr(text)["p2p"] for text in initial_peers):
            try:
                answer = await ask_dial_back(probe, PeerID.from_base58(peer), ports, options.dial_back_timeout_s)
            except Exception as error:  # an older member, or one that went away: ask the next
                logger.info("bootstrap peer %s did not answer the reachability check: %s", peer, error)
                continue
            if answer.error is None:
                answers.append(answer)
                if answer.peer_public:  # only a public peer's dial tells what the internet sees
                    break
    finally:
        await stop_probe(probe)
    return _verdict(answers, ports)


def _verdict(answers: list[DialBackAnswer], ports: list[int]) -> Reachability:
    public = [a for a in answers if a.peer_public]
    if not answers:
        return Reachability("private", "no bootstrap peer answered the reachability check")
    if not public:  # a private peer that reached us may share our LAN: that proves nothing
        raise NoPublicMember(
            "this node is behind NAT and none of its bootstrap peers is publicly reachable, so "
            "no member can relay for it: a swarm needs at least one public member (a host with "
            "an open or forwarded port, joined with --reachability public or --announce).")
    answer = public[0]
    if answer.reachable:
        return Reachability("public", f"{answer.peer[-8:]} opened {answer.observed}:{answer.reachable[0]}")
    shown = ", ".join(str(p) for p in ports) or "none"
    return Reachability("private", f"{answer.peer[-8:]} could not open {answer.observed} on port(s) {shown}")


class NoPublicMember(HostError):
    """Every bootstrap peer that answered is behind NAT itself."""
