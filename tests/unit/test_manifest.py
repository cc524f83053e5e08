import pytest

from node.config.schema import ConfigError
from node.config.manifest import (Manifest, differences, find_manifest, load_manifest,
                           manifest_from_dict, write_manifest)


def test_shipped_manifests_load_and_round_trip(tmp_path):
    for swarm in ("local", "local-dilocox"):
        m = load_manifest(find_manifest(swarm))
        assert m.swarm.id == swarm
        again = load_manifest(write_manifest(m, tmp_path / f"{swarm}.toml"))
        assert again.digest == m.digest


def test_digest_ignores_bootstrap_peers_and_node_local_settings():
    a, b = Manifest(), Manifest()
    b.network.bootstrap_peers = ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWabc"]
    b.train.threads, b.train.device = 1, "cpu"
    assert a.digest == b.digest
    b.protocol.inner_steps = 7
    assert a.digest != b.digest


def test_differences_name_the_fields():
    a, b = Manifest(), Manifest()
    b.protocol.inner_steps, b.model.dim = 20, 96
    assert differences(a.agreed(), b.agreed()) == [
        "model.dim (192 here vs 96 there)", "protocol.inner_steps (50 here vs 20 there)"]


def test_unknown_swarm_lists_the_known_ones():
    with pytest.raises(ConfigError, match="no manifest for swarm 'nope' .*known: .*local"):
        find_manifest("nope")


@pytest.mark.parametrize("values, fragment", [
    ({"swarm": {"id": "Bad Id"}}, "is not a valid swarm id"),
    ({"protocol": {"name": "allreduce"}}, "config key 'protocol.name' = 'allreduce' is not allowed"),
    ({"admission": {"mode": "allowlist"}}, "admission.public_keys' is empty"),
    ({"protocol": {"inner_steps": 0}}, "config key 'protocol.inner_steps' = 0 is out of range"),
    ({"network": {"bootstrap_peers": "one"}}, "expected a list of strings"),
    ([1, 2], "a manifest must be a table of sections"),
    ({"protocol": {"snapshot": "phi"}}, "config key 'protocol.snapshot' = 'phi' is not allowed"),
    ({"protocol": {"progress_weight": 0.6}}, "needs progress_weight = consensus_weight, but they "
     "are 0.6 and 0.7: set protocol.snapshot = 'phi_delta'"),
    ({"contributions": {"min_alignment_sigmas": 2.0}}, "which protocol.snapshot = 'theta' does "
     "not send: set protocol.snapshot = 'phi_delta' or min_alignment_sigmas = 0"),
])
def test_bad_manifests_are_refused(values, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        manifest_from_dict(values)


@pytest.mark.parametrize("values", [
    {"protocol": {"snapshot": "phi_delta", "progress_weight": 0.6}},
    {"protocol": {"snapshot": "phi_delta"}, "contributions": {"min_alignment_sigmas": 2.0}},
    {"protocol": {"name": "dilocox", "progress_weight": 0.6}},  # NoLoCo's keys unused there
])
def test_snapshot_phi_delta_fits_what_theta_does_not(values):
    assert manifest_from_dict(values).protocol.snapshot == values["protocol"].get("snapshot", "theta")
