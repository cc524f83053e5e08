"""docker/Dockerfile's CPU image, built and run for real on a private Docker engine.

What a cloud user does, on this machine: build the image (offline, from a wheelhouse of the
locked wheels, on a stand-in base: see tests/docker_engine.py), ask it for --help, run `join` with a
named volume, `docker stop` it (exit 0 within the grace, with a checkpoint), start a replacement
on the same volume (same peer id, resumed), and let a second container of the swarm pair with
it. The numbers land in runs/docker-smoke.json. The engine, its containers, volumes, network
and bridge are removed afterwards, and the test fails if anything is left on the host.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.docker_engine import TAG, PrivateEngine, fill_wheelhouse, import_standin, missing_tools

pytestmark = [pytest.mark.integration, pytest.mark.host_network, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
WHEELHOUSE = ROOT / "docker" / "wheelhouse"
IMAGE = "lowcomm-node:cpu"
SUBNET, IP_A, IP_B = "10.231.7.0/24", "10.231.7.11", "10.231.7.12"
# two nodes share this machine's two cores; rounds of 10 steps make the first swap come sooner
NODE_ARGS = ["--set", "train.threads=1", "--set", "protocol.inner_steps=10"]
RESULTS = ROOT / "runs" / "docker-smoke.json"


def dockerfile_arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M).group(1)


@pytest.fixture(scope="module")
def measured():
    numbers: dict = {}
    yield numbers
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(numbers, indent=1) + "\n")
    print("\ndocker smoke:", json.dumps(numbers))


@pytest.fixture(scope="module")
def engine():
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    engine = PrivateEngine()
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()
        print(f"\ndocker smoke: engine stopped and removed in {engine.stop_phases}")
        left = engine.leftovers()
        assert not left, f"the Docker engine left these behind: {left}"


@pytest.fixture(scope="module")
def image(engine, measured):
    base = dockerfile_arg("PYTHON_IMAGE")
    import_standin(engine, base)  # named a stand-in in its label, see tests/docker_engine.py
    fill_wheelhouse(WHEELHOUSE, ROOT / "docker" / "requirements-cpu.lock",
                    f"torch=={dockerfile_arg('TORCH_VERSION')}+cpu")
    index = "file:///docker/wheelhouse/simple"
    started = time.monotonic()
    engine.docker("build", "--network", "none", "-f", str(DOCKERFILE), "--build-arg", "TORCH=cpu",
                  "--build-arg", f"PIP_INDEX_URL={index}", "--build-arg", f"TORCH_INDEX_URL={index}",
                  "-t", IMAGE, str(ROOT), timeout=1200)
    measured["build_s"] = round(time.monotonic() - started, 1)
    measured["base"] = f"stand-in for {base} (debootstrap bookworm, Debian python3)"
    measured["image_bytes"] = engine.inspect(IMAGE)["Size"]
    layers = engine.docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}",
                           IMAGE).stdout.splitlines()
    measured["largest_layers"] = [line[:100] for line in layers if line.split("\t")[0][-2:]
                                  in ("MB", "GB")]
    engine.docker("network", "create", "--driver", "bridge", "--subnet", SUBNET, "-o",
                  f"com.docker.network.bridge.name={TAG}-br0", f"{TAG}-net")
    return IMAGE


def run(engine, *args, **kw):
    return engine.docker("run", "--rm", "--network", "none", *args, check=False, **kw)


def test_help_subcommands_and_refusals(engine, image):
    for argv in (["--help"], ["lowcomm-node", "--help"]):
        shown = run(engine, image, *argv)
        assert shown.returncode == 0, shown.stderr
        assert "LOWCOMM_SWARM" in shown.stdout and "usage: lowcomm-node" in shown.stdout
    keys = run(engine, image, "config", "--keys")
    assert keys.returncode == 0 and "train.device" in keys.stdout, keys.stderr
    join_help = run(engine, image, "lowcomm-node", "join", "--help")
    assert join_help.returncode == 0 and "usage: lowcomm-node join" in join_help.stdout
    shell = run(engine, image, "python3", "-c", "import sys; print(sys.version_info[:2])")
    assert shell.stdout.strip() == "(3, 11)", shell.stderr
    nothing = run(engine, image)
    assert nothing.returncode == 2 and "set LOWCOMM_SWARM" in nothing.stderr
    # The GPU image's start check (LOWCOMM_GPU_IMAGE=1 there), on this CPU-only torch:
    refused = run(engine, "-e", "LOWCOMM_GPU_IMAGE=1", "-e", "LOWCOMM_SWARM=local", image)
    assert refused.returncode == 3, refused.stderr
    assert "LOWCOMM_DEVICE=cpu" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def start_node(engine, name, ip, volume, *env):
    engine.docker("run", "-d", "--name", name, "--network", f"{TAG}-net", "--ip", ip,
                  "--stop-timeout", "40", "-v", f"{volume}:/data", "-e", "LOWCOMM_SWARM=local",
                  "-e", f"LOWCOMM_ANNOUNCE_HOST={ip}", *env, IMAGE, *NODE_ARGS)


def status(engine, name) -> dict | None:
    shown = engine.docker("exec", name, "lowcomm-node", "status", "--json", "--data-dir", "/data",
                          check=False, timeout=30)
    return json.loads(shown.stdout) if shown.returncode == 0 else None


def events(engine, name) -> list[dict]:
    shown = engine.docker("exec", name, "cat", "/data/metrics.jsonl", check=False, timeout=30)
    return [json.loads(line) for line in shown.stdout.splitlines() if line.strip()]


def wait_for(what, predicate, timeout_s, engine, name):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        if not engine.inspect(name)["State"]["Running"]:
            break
        time.sleep(1)
    raise AssertionError(f"{name}: no {what} within {timeout_s}s; {log_tail(engine, name)}")


def log_tail(engine, name) -> str:
    state = engine.inspect(name)["State"]
    logs = engine.docker("logs", "--tail", "30", name, check=False)
    return (f"{name} is {state['Status']} (exit code {state['ExitCode']}); its log ends:\n"
            f"{logs.stdout[-3000:]}{logs.stderr[-3000:]}")


def test_join_stop_resume_and_pair(engine, image, measured):
    # 1. join with a named volume; the node announces the address given in the environment
    start_node(engine, f"{TAG}-a", IP_A, f"{TAG}-a")
    first = wait_for("training step 3", lambda: (s := status(engine, f"{TAG}-a"))
                     and (s.get("step") or 0) >= 3 and s, 240, engine, f"{TAG}-a")
    peer_id = first["peer_id"]
    joined = next(e for e in events(engine, f"{TAG}-a") if e["event"] == "joined")
    assert joined["addresses"] == [f"/ip4/{IP_A}/tcp/4100/p2p/{peer_id}"], joined["addresses"]

    # 2. docker stop: SIGTERM, checkpoint, exit 0 well within the stop timeout
    started = time.monotonic()
    engine.docker("stop", f"{TAG}-a", timeout=120)
    measured["stop_to_exit_s"] = round(time.monotonic() - started, 2)
    state = engine.inspect(f"{TAG}-a")["State"]
    assert state["ExitCode"] == 0 and measured["stop_to_exit_s"] < 30, log_tail(engine, f"{TAG}-a")
    engine.docker("rm", f"{TAG}-a")
    listed = run(engine, "-v", f"{TAG}-a:/data", image, "ls", "/data/checkpoints")
    checkpoints = [n for n in listed.stdout.split() if n.startswith("ckpt-")]
    assert checkpoints, f"no checkpoint in the volume after docker stop: {listed.stdout}"
    measured["checkpoint_after_stop"] = checkpoints[-1]

    # 3. a replacement container on the same volume: the same peer, resumed from the checkpoint
    start_node(engine, f"{TAG}-a", IP_A, f"{TAG}-a")
    resumed = wait_for("resumed event", lambda: [e for e in events(engine, f"{TAG}-a")
                                                 if e["event"] == "resumed"], 240, engine,
                       f"{TAG}-a")
    again = wait_for("status", lambda: status(engine, f"{TAG}-a"), 120, engine, f"{TAG}-a")
    assert again["peer_id"] == peer_id
    measured["peer_id"] = peer_id
    measured["resumed"] = {"checkpoint": resumed[-1]["checkpoint"], "step": resumed[-1]["step"]}

    # 4. a second container of the swarm bootstraps from it, and the two pair and swap
    start_node(engine, f"{TAG}-b", IP_B, f"{TAG}-b",
               "-e", f"LOWCOMM_PEERS=/ip4/{IP_A}/tcp/4100/p2p/{peer_id}")
    other = wait_for("status", lambda: status(engine, f"{TAG}-b"), 240, engine, f"{TAG}-b")
    other_id = other["peer_id"]

    def swapped(name, partner):
        return [e for e in events(engine, name) if e["event"] == "swapped"
                and e.get("partner") == partner]

    started = time.monotonic()
    a_swaps = wait_for("swap with b", lambda: swapped(f"{TAG}-a", other_id), 300, engine,
                       f"{TAG}-a")
    b_swaps = wait_for("swap with a", lambda: swapped(f"{TAG}-b", peer_id), 120, engine,
                       f"{TAG}-b")
    measured["pair"] = {"a": peer_id, "b": other_id, "a_round": a_swaps[0]["round"],
                        "b_round": b_swaps[0]["round"],
                        "first_swap_after_b_up_s": round(time.monotonic() - started, 1)}
    for name in (f"{TAG}-a", f"{TAG}-b"):
        engine.docker("stop", name, timeout=120)
        assert engine.inspect(name)["State"]["ExitCode"] == 0, log_tail(engine, name)

