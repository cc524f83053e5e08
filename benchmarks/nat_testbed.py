"""An "internet" with public members and homes behind NAT routers, in network namespaces.

    with NatTestbed(publics=1, homes=2, rate="20mbit") as net:   # needs root, ip, iptables
        net.public_address(0)        # 11.22.0.10: a public member's address
        net.home_address(1)          # 192.168.2.2: home 1, behind router 1 (11.22.0.101)
        net.popen(net.home(1), [...])
        net.tcp_reachable(net.public(0), net.router_address(1), port)   # False: the NAT drops it

Layout: one namespace holds the internet's bridge (`br0`); each public namespace and each
router's WAN side is a veth port on it. Each home sits on its own LAN behind its router, which
masquerades outgoing traffic, forwards only replies (conntrack ESTABLISHED,RELATED) and drops
every unsolicited packet silently, as home routers do (a router that answered them would let a
punch packet move the NAT mapping: see notes/containers-and-nat.md).

Why 11.22.0.0/24: libp2p ignores private and TEST-NET ranges for relaying and hole punching, so
the internet must look public. These addresses exist only inside namespaces this testbed made,
which have no route out of them; nothing here reaches the real internet.

`rate`: tbf limits each WAN port both ways (a node's upload and download), so a relayed transfer
and a direct one see the same access links. Clean-up: every process started with popen, then
every namespace (with them their veths, qdiscs and iptables rules) on exit, on SIGINT/SIGTERM,
by atexit; namespaces of a crashed earlier run are swept at the next start.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from benchmarks.netns import NamespaceSet

PREFIX = "nat-"
INTERNET = "11.22.0"  # public-looking, used only inside these namespaces (see above)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """None when the testbed can be built here, else why not (for a skip)."""
    if os.geteuid() != 0:
        return "the NAT testbed needs root (network namespaces, iptables)"
    missing = [tool for tool in ("ip", "iptables", "tc") if shutil.which(tool) is None]
    return f"missing tools: {', '.join(missing)}" if missing else None


class NatTestbed(NamespaceSet):
    prefix = PREFIX
    stop_timeout_s = 30.0

    def __init__(self, publics: int = 1, homes: int = 2, rate: str | None = None,
                 burst: str = "256kb", queue_latency: str = "100ms"):
        if not (1 <= publics <= 50 and 0 <= homes <= 50):
            raise ValueError(f"a testbed has 1-50 public namespaces and 0-50 homes, not {publics}/{homes}")
        super().__init__()
        self.publics, self.homes, self.rate = publics, homes, rate
        self.burst, self.queue_latency = burst, queue_latency
        self.internet = f"{self.tag}-inet"

    # ------------------------------------------------------------------ names and addresses
    def public(self, i: int) -> str:
        return f"{self.tag}-pub{i}"

    def router(self, j: int) -> str:
        return f"{self.tag}-r{j}"

    def home(self, j: int) -> str:
        return f"{self.tag}-h{j}"

    def public_address(self, i: int) -> str:
        return f"{INTERNET}.{10 + i}"

    def router_address(self, j: int) -> str:
        """Home j's address as the internet sees it (its router's WAN side)."""
        return f"{INTERNET}.{100 + j}"

    def home_address(self, j: int) -> str:
        return f"192.168.{j + 1}.2"

    # ------------------------------------------------------------------ building
    def unavailable(self) -> str | None:
        return unavailable()

    def _plug(self, namespace: str, device: str, port: str, address: str) -> None:
        """A veth from `namespace` (as `device`, with `address`/24) to the internet's bridge."""
        _run("ip", "-n", namespace, "link", "add", device, "type", "veth", "peer", "name", port,
             "netns", self.internet)
        _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
        _run("ip", "-n", namespace, "link", "set", device, "up")
        _run("ip", "-n", self.internet, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.internet, "link", "set", port, "up")
        if self.rate:  # both directions: the namespace's upload and its download
            for where, dev in ((namespace, device), (self.internet, port)):
                _run("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", self.rate, "burst", self.burst, "latency", self.queue_latency)

    def _build(self) -> None:
        self._namespace(self.internet)
        _run("ip", "-n", self.internet, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.internet, "link", "set", "br0", "up")
        for i in range(self.publics):
            self._namespace(self.public(i))
            self._plug(self.public(i), "eth0", f"pub{i}", self.public_address(i))
        for j in range(self.homes):
            self._build_home(j)

    def _build_home(self, j: int) -> None:
        router, home, lan = self.router(j), self.home(j), f"192.168.{j + 1}"
        self._namespace(router)
        self._namespace(home)
        self._plug(router, "wan", f"r{j}", self.router_address(j))
        _run("ip", "-n", home, "link", "add", "eth0", "type", "veth", "peer", "name", "lan", "netns", router)
        _run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan")
        _run("ip", "-n", router, "link", "set", "lan", "up")
        _run("ip", "-n", home, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _run("ip", "-n", home, "link", "set", "eth0", "up")
        _run("ip", "-n", home, "route", "add", "default", "via", f"{lan}.1")
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = [
            ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"],
            ["-P", "FORWARD", "DROP"],
            ["-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            # unsolicited packets to the router itself vanish too (no RST, no ICMP)
            ["-P", "INPUT", "DROP"],
            ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
            ["-A", "INPUT", "-i", "lan", "-j", "ACCEPT"],
            ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ]
        for rule in rules:
            _run("ip", "netns", "exec", router, "iptables", *rule)

    # ------------------------------------------------------------------ using
    def popen(self, namespace: str, argv: list[str], **options) -> subprocess.Popen:
        """Start a process in `namespace`; it is killed when the testbed closes."""
        return self._popen_in(namespace, argv, **options)

    def tcp_reachable(self, namespace: str, address: str, port: int, timeout_s: float = 2.0) -> bool:
        """Whether a TCP connection from `namespace` to address:port opens within the timeout."""
        probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                 "timeout=float(sys.argv[3])).close()\nexcept OSError:\n sys.exit(1)")
        done = subprocess.run(["ip", "netns", "exec", namespace, "python3", "-c", probe, address,
                               str(port), str(timeout_s)], capture_output=True, timeout=timeout_s + 10)
        return done.returncode == 0

    def forward_port(self, j: int, port: int) -> None:
        """Router j forwards TCP `port` on its WAN address to its home (a volunteer's port forward)."""
        home = f"{self.home_address(j)}"
        for rule in (["-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "tcp", "--dport", str(port),
                      "-j", "DNAT", "--to-destination", f"{home}:{port}"],
                     ["-A", "FORWARD", "-i", "wan", "-o", "lan", "-p", "tcp", "-d", home, "--dport", str(port),
                      "-j", "ACCEPT"]):
            _run("ip", "netns", "exec", self.router(j), "iptables", *rule)

    def nat_rules(self, j: int) -> str:
        return _run("ip", "netns", "exec", self.router(j), "iptables", "-S").stdout + \
            _run("ip", "netns", "exec", self.router(j), "iptables", "-t", "nat", "-S").stdout

    def namespaces(self) -> list[str]:
        return list(self._created)
