"""How the suite shares the machine between pytest-xdist's workers (`make test`: -n 2 --dist
loadfile, each test file whole on one worker, so a file's module fixtures start once).

The files marked `host_network` change the host's own network: a Docker engine's bridge and
firewall rules, a veth pair on the host, NAT routers' iptables; their checks compare the host's
links and rules before and after. Each holds a lock on the host for its whole file, so no two of
them run at the same time, whichever workers (or pytest runs) they are in. (xdist's loadgroup
would say this in the scheduler, but pytest-xdist 3.8 does not read groups under pytest 9.2.)
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

HOST_NETWORK_LOCK = Path("/tmp/lowcomm-node-tests-host-network.lock")


@pytest.fixture(scope="module", autouse=True)
def host_network_turn(request):
    """Autouse and module-scoped: set up before the file's other module fixtures (an engine)."""
    if request.node.get_closest_marker("host_network") is None:
        yield
        return
    with open(HOST_NETWORK_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        yield
