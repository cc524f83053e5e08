"""A real mosquitto for tests: `mosquitto_broker` starts one on a free loopback port.

The broker gets a generated config in the test's temporary directory (loopback only,
anonymous, `user root` when running as root, no persistence). The fixture waits, bounded,
until it accepts connections, and at teardown stops it and removes its files. Tests may
`kill()` and `start()` it again on the same port to play a broker outage.

Tests using it skip, saying why, only when mosquitto is not installed (.ci/setup installs
Debian's package).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import aiomqtt
import pytest

from node.ops.telemetry import parse_mqtt_url

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.path.exists(p)), None)
START_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MosquittoBroker:
    """`listener_options` replace `allow_anonymous true` (e.g. TLS files, a password file)."""

    def __init__(self, workdir: Path, port: int | None = None,
                 listener_options: list[str] | None = None):
        self.workdir = workdir
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.config = workdir / "mosquitto.conf"
        self.log_file = workdir / "mosquitto.log"
        options = listener_options if listener_options is not None else ["allow_anonymous true"]
        lines = [f"listener {self.port} 127.0.0.1", *options,
                 "persistence false", f"log_dest file {self.log_file}",
                 "log_type error", "log_type warning", "log_type notice"]
        if os.geteuid() == 0:
            lines.append("user root")  # otherwise it drops to a 'mosquitto' user
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")
                log = self.log_file.read_text() if self.log_file.exists() else ""
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}: {err}{log}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.02)  # bounded: START_TIMEOUT
        self.stop()
        raise RuntimeError(f"mosquitto did not accept connections on port {self.port} "
                           f"within {START_TIMEOUT:g} s")

    def kill(self) -> None:
        """SIGKILL: the outage as the clients see it (no goodbye)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None


def require_mosquitto() -> str:
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (bash .ci/setup installs Debian's mosquitto "
                    "when run as root with apt-get)")
    return MOSQUITTO


@pytest.fixture
def mosquitto_broker():
    require_mosquitto()
    workdir = Path(tempfile.mkdtemp(prefix="lowcomm-mosquitto-"))
    broker = MosquittoBroker(workdir)
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def retained(url: str, topic: str, predicate=lambda doc: True, timeout: float = 10.0):
    """The first message on `topic` (retained or live) whose JSON satisfies `predicate`."""
    target = parse_mqtt_url(url)
    async with aiomqtt.Client(target.host, target.port) as client:
        await client.subscribe(topic, qos=1)

        async def first():
            async for message in client.messages:
                doc = json.loads(message.payload)
                if predicate(doc):
                    return message, doc

        return await asyncio.wait_for(first(), timeout)
