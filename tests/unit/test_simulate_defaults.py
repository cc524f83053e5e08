"""`simulate`'s defaults are what a swarm ships: NoLoCo's and DiLoCoX's every [protocol] key is
the manifest's (ProtocolSection, and the values configs/swarms/*.toml set), and DiLoCo's
baseline runs the outer momentum benchmarks/RESULTS.md names its best measured."""

import argparse
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from node.config.manifest import SWARM_DIR, ProtocolSection, load_manifest
from node.simulator.settings import (DEFAULT_INNER_STEPS, DILOCO_BASELINE, PROTOCOLS,
                                     SimulationSettings)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"
# Simulated time is counted in inner steps: the simulator's deadlines are H steps, not the
# manifest's seconds (SimulationSettings.sections), and `name` is the simulated protocol.
NOT_COMPARED = {"name", "pair_deadline_s", "message_deadline_s"}
# The demo swarms' files set these two for one machine: rounds of 25 steps and bf16 snapshots.
# Their digests are pinned by the released fixtures (tests/fixtures/releases/*/local.toml), so
# these values cannot move without breaking a compatible release; every other key they set is
# the default.
DEMO_SWARM_VALUES = {"inner_steps", "wire_dtype"}


def cli_settings(protocol: str) -> SimulationSettings:
    """What `lowcomm-node simulate --protocol PROTOCOL --rounds 1` runs, flags as parsed."""
    from node.simulator.cli import add_simulate_command, settings_from_args
    parser = argparse.ArgumentParser().add_subparsers()
    add_simulate_command(parser)
    args = parser.choices["simulate"].parse_args(["--protocol", protocol, "--rounds", "1"])
    return settings_from_args(args, 100)


def compared(section: ProtocolSection) -> dict:
    return {k: v for k, v in asdict(section).items() if k not in NOT_COMPARED}


@pytest.mark.parametrize("protocol", ["noloco", "dilocox"])
@pytest.mark.parametrize("built", ["settings", "cli"])
def test_a_simulated_swarm_protocol_runs_every_manifest_default(protocol, built):
    settings = SimulationSettings(protocol).validated() if built == "settings" else cli_settings(protocol)
    simulated, _ = settings.sections()
    assert compared(simulated) == compared(ProtocolSection())
    assert simulated.name == protocol


def test_every_method_defaults_to_the_manifests_h():
    for protocol in PROTOCOLS:
        assert SimulationSettings(protocol).validated().inner_steps == ProtocolSection().inner_steps
        assert cli_settings(protocol).inner_steps == ProtocolSection().inner_steps
    assert set(DEFAULT_INNER_STEPS) == set(PROTOCOLS)


@pytest.mark.parametrize("path", sorted(SWARM_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_a_shipped_swarm_file_sets_the_simulators_defaults(path):
    """Every [protocol] value a shipped swarm file sets is what `simulate` runs by default, the
    demo's own two apart."""
    manifest = load_manifest(path)
    simulated, _ = SimulationSettings(manifest.protocol.name).validated().sections()
    shipped = {k: v for k, v in compared(manifest.protocol).items() if k not in DEMO_SWARM_VALUES}
    assert shipped == {k: v for k, v in compared(simulated).items() if k in shipped}
    # the deadlines the simulator counts in steps are the manifest's defaults in the file
    for key in ("pair_deadline_s", "message_deadline_s"):
        assert getattr(manifest.protocol, key) == getattr(ProtocolSection(), key), key


def test_dilocos_baseline_is_its_best_measured_outer_step():
    for settings in (SimulationSettings("diloco").validated(), cli_settings("diloco")):
        assert (settings.outer_lr, settings.outer_momentum) == (DILOCO_BASELINE.outer_lr,
                                                                DILOCO_BASELINE.momentum)
    section = RESULTS.read_text(encoding="utf-8").split("## DiLoCo's outer momentum", 1)[1]
    section = section.split("\n## ", 1)[0]
    best = re.search(r"best: μ = ([0-9.]+)", section)
    assert best is not None, "RESULTS.md's DiLoCo outer momentum section names no best μ"
    assert float(best.group(1)) == DILOCO_BASELINE.momentum
