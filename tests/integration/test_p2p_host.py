"""Starting and stopping a node's p2pd + DHT: the identity is the libp2p one, errors are clear."""

from __future__ import annotations

import os

import pytest

from p2p.errors import HostError
from p2p.host import P2PHost, p2pd_socket_paths
from p2p.identity import NodeIdentity, identity_path, public_key_from_peer_id
from p2p.streams import Transport
from tests.p2p_helpers import run

pytestmark = pytest.mark.integration


def test_host_runs_under_our_ed25519_key_and_cleans_up(tmp_path, p2p_cleanup):
    async def scenario():
        identity = NodeIdentity.load_or_create(identity_path(tmp_path))
        host = p2p_cleanup.track_host(await P2PHost.start(identity))
        sockets = p2pd_socket_paths(host.p2p)
        assert host.peer_id == identity.peer_id
        assert public_key_from_peer_id(host.peer_id).public_bytes_raw() == identity.public_key_bytes
        assert all(addr.startswith("/ip4/127.0.0.1/tcp/") and addr.endswith(f"/p2p/{identity.peer_id}")
                   for addr in await host.maddrs())
        child = host.p2p._child
        await host.shutdown()
        await host.shutdown()  # idempotent
        assert child.returncode is not None, "p2pd still running after shutdown"
        assert not [path for path in sockets if os.path.exists(path)]
        with pytest.raises(HostError, match="another identity"):
            Transport(host.p2p, NodeIdentity.generate(), swarm="s", manifest="m")
    run(scenario(), timeout_s=60)


def test_bad_initial_peers_and_keyless_identity_are_one_clear_sentence(tmp_path, p2p_cleanup):
    async def scenario():
        identity = NodeIdentity.load_or_create(identity_path(tmp_path))
        nobody = NodeIdentity.generate().peer_id
        with pytest.raises(HostError, match=r"none of the bootstrap peers .* answered: they are down or their addresses are wrong"):
            await P2PHost.start(identity, initial_peers=[f"/ip4/127.0.0.1/tcp/9/p2p/{nobody}"])
        for bad in ("garbage", "/ip4/127.0.0.1/tcp/9"):
            with pytest.raises(HostError, match="is not a multiaddr with a peer id"):
                await P2PHost.start(identity, initial_peers=[bad])
        with pytest.raises(HostError, match="no key file"):
            await P2PHost.start(NodeIdentity.generate())
    run(scenario(), timeout_s=60)
