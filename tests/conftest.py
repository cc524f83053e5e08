"""How the suite is split between pytest-xdist's workers (`make test`: -n 2 --dist loadgroup).

Every test file runs whole on one worker, so a file's module fixtures (a shared swarm, a Docker
engine) start once. The files marked `host_network` change the host's own network: a Docker
engine's bridge and firewall rules, a veth pair on the host, NAT routers' iptables; their checks
compare the host's links and rules before and after. They share one group, so no two of them run
at the same time.
"""

from __future__ import annotations

import pytest

HOST_NETWORK_GROUP = "host-network"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = HOST_NETWORK_GROUP if item.get_closest_marker("host_network") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
