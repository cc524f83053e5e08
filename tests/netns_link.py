"""One network namespace joined to the root namespace by a veth pair, whose link a test can cut
and restore (issue 8's link fault). Needs root and `ip`; everything is removed on exit, even
after a failure, and namespaces left by a killed earlier run are swept first.

    with NamespaceLink() as link:       # link.namespace, link.host_address, link.inner_address
        node = harness.start_node(..., netns=link.namespace, listen=link.inner_listen)
        link.cut(); ...; link.restore()
        link.shape("500kbit")              # tbf, both ways

Traffic stays on this machine: the pair's /30 subnet is private and has no route out.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from benchmarks.netns import sweep_stale_namespaces

PREFIX = "lctest-"


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    return None


class NamespaceLink:
    def __init__(self, subnet: str = "10.79.0"):
        self.namespace = f"{PREFIX}{os.getpid()}"
        self.host_if, self.inner_if = f"lch{os.getpid() % 100000}", f"lcn{os.getpid() % 100000}"
        self.host_address, self.inner_address = f"{subnet}.1", f"{subnet}.2"

    @property
    def host_listen(self) -> str:
        return f"/ip4/{self.host_address}/tcp/0"

    @property
    def inner_listen(self) -> str:
        return f"/ip4/{self.inner_address}/tcp/0"

    def __enter__(self) -> "NamespaceLink":
        sweep_stale_namespaces(PREFIX)
        try:
            _ip("netns", "add", self.namespace)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.inner_if)
            _ip("link", "set", self.inner_if, "netns", self.namespace)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_if)
            _ip("-n", self.namespace, "addr", "add", f"{self.inner_address}/30", "dev", self.inner_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.namespace, "link", "set", self.inner_if, "up")
            _ip("-n", self.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # The namespace's end goes down: nothing crosses the pair either way, while the host end
    # (admin up, no carrier) keeps its local address, so nodes of the root namespace that
    # listen on it still reach each other.
    def cut(self) -> None:
        _ip("-n", self.namespace, "link", "set", self.inner_if, "down")

    def restore(self) -> None:
        _ip("-n", self.namespace, "link", "set", self.inner_if, "up")

    def shape(self, rate: str, burst: str = "16kb", latency: str = "200ms") -> None:
        """Limits the link to `rate` (a tc rate word: 500kbit) each way with tbf: the namespace's
        upload on its end, its download on the host's end."""
        for namespace, device in ((self.namespace, self.inner_if), (None, self.host_if)):
            _ip_tc = ["ip", "netns", "exec", namespace, "tc"] if namespace else ["tc"]
            subprocess.run([*_ip_tc, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", latency], check=True, capture_output=True, text=True)

    def close(self) -> None:
        _ip("link", "del", self.host_if, check=False)  # takes its peer with it
        _ip("netns", "del", self.namespace, check=False)
