"""MQTT telemetry against a real mosquitto: retained status, last will, monitor, outages."""

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as paho_client
import pytest

from node.ops.status import DERIVED, SCHEMA_VERSION, NodeStatus
from node.ops.telemetry import TelemetryPublisher, status_topic
from tests.mqtt_broker import retained

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("publish_status.py")
CLI = [sys.executable, "-m", "node.cli"]
SCHEMA_KEYS = {f.name for f in dataclasses.fields(NodeStatus)} | set(DERIVED)


def node_status(peer: str, swarm: str, **values) -> NodeStatus:
    s = NodeStatus(peer_id=peer, swarm=swarm, protocol="noloco", state="training", round=5,
                   step=500, rounds_per_minute=2.0, **values)
    s.record_train_loss(3.0)
    return s


def test_status_is_published_retained_with_the_schema(mosquitto_broker):
    status = node_status("12D3KooWretained", "tele", tokens_per_second=1234.0,
                         refused={"bad_digest": 1})

    async def main():
        pub = TelemetryPublisher(mosquitto_broker.url, "tele", "12D3KooWretained",
                                 status.to_dict, interval=0.2)
        pub.start()
        try:
            await asyncio.wait_for(pub.first_publish.wait(), 10)
            # a subscriber that comes later gets it at once: the broker retained it
            message, doc = await retained(mosquitto_broker.url, pub.topic)
        finally:
            await pub.stop()
        _, gone = await retained(mosquitto_broker.url, pub.topic, lambda d: True)
        return message, doc, gone

    message, doc, gone = asyncio.run(main())
    assert message.retain and str(message.topic) == "lowcomm/tele/12D3KooWretained/status"
    assert set(doc) == SCHEMA_KEYS and doc["schema"] == SCHEMA_VERSION
    assert doc["online"] is True and doc["tokens_per_second"] == 1234.0
    assert doc["refused"] == {"bad_digest": 1} and doc["train_loss_trend"] == [3.0]
    assert gone["online"] is False and gone["state"] == "offline", "a clean stop says offline"


def test_sigkilled_publisher_is_marked_offline_by_its_last_will(mosquitto_broker):
    url, topic = mosquitto_broker.url, status_topic("tele", "12D3KooWkilled")

    async def main():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), url, "tele", "12D3KooWkilled", "0.2",
            stdout=subprocess.PIPE)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            assert line.strip() == b"published"
            _, online = await retained(url, topic)
            proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), 10)
            _, offline = await retained(url, topic, lambda d: d.get("online") is False)
            return online, offline
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    online, offline = asyncio.run(main())
    assert online["online"] is True and online["peer_id"] == "12D3KooWkilled"
    assert offline == {**offline, "online": False, "state": "offline",
                       "peer_id": "12D3KooWkilled", "swarm": "tele"}


def test_monitor_once_json_lists_every_node(mosquitto_broker):
    speeds = {"12D3KooWnodeA": 1000.0, "12D3KooWnodeB": 900.0, "12D3KooWnodeC": 100.0}
    statuses = {peer: node_status(peer, "mon", tokens_per_second=tps)
                for peer, tps in speeds.items()}

    async def main():
        pubs = [TelemetryPublisher(mosquitto_broker.url, "mon", peer, s.to_dict, interval=0.5)
                for peer, s in statuses.items()]
        other = TelemetryPublisher(mosquitto_broker.url, "another-swarm", "12D3KooWother",
                                   node_status("12D3KooWother", "another-swarm").to_dict)
        for p in (*pubs, other):
            p.start()
        try:
            for p in (*pubs, other):
                await asyncio.wait_for(p.first_publish.wait(), 10)
            proc = await asyncio.create_subprocess_exec(
                *CLI, "monitor", "--mqtt", mosquitto_broker.url, "--swarm", "mon", "--once",
                "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            table = await asyncio.create_subprocess_exec(
                *CLI, "monitor", "--mqtt", mosquitto_broker.url, "--swarm", "mon", "--once",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            table_out, _ = await asyncio.wait_for(table.communicate(), 30)
            return proc.returncode, out.decode(), err.decode(), table_out.decode()
        finally:
            for p in (*pubs, other):
                await p.stop()

    rc, out, err, table = asyncio.run(main())
    assert rc == 0, err
    snapshot = json.loads(out)
    assert snapshot["swarm"] == "mon"
    assert [n["peer_id"] for n in snapshot["nodes"]] == sorted(speeds)
    assert all(n["online"] and n["schema"] == SCHEMA_VERSION for n in snapshot["nodes"])
    assert snapshot["totals"]["online"] == 3
    assert snapshot["totals"]["tokens_per_second"] == pytest.approx(2000.0)
    assert snapshot["stragglers"] == ["12D3KooWnodeC"]
    assert "3/3 online" in table and "12D3KooWnodeC *" in table


def test_monitor_says_clearly_when_the_broker_is_away():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([*CLI, "monitor", "--mqtt", f"mqtt://127.0.0.1:{port}", "--swarm",
                             "x", "--once", "--json", "--timeout", "2"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith("lowcomm-node: error: cannot read swarm 'x' from the MQTT "
                                    f"broker mqtt://127.0.0.1:{port}")


class MqttThreads:
    """A spy on the real paho client under aiomqtt (the real functions run): which thread opens
    each connection (name lookup, TCP connect, TLS handshake: the calls that block), and whether
    each read and write made on the event loop's thread goes to a non-blocking socket. Where no
    connection is opened on the loop's thread and none of its reads or writes can block, no
    outage (a dead broker, one that never answers) can stall the loop, and through it the node's
    training thread, which meets the publisher only there."""

    def __init__(self, monkeypatch):
        self.loop_thread: int | None = None  # set from inside the loop
        self.opened: Counter = Counter()     # "loop" / "elsewhere": connections opened there
        self.loop_io: Counter = Counter()    # "non-blocking" / "blocking": the loop's reads, writes
        client = paho_client.Client
        for name, record in (("_create_socket", self._opened), ("_sock_recv", self._io),
                             ("_sock_send", self._io)):
            monkeypatch.setattr(client, name, self._spied(getattr(client, name), record))

    @staticmethod
    def _spied(original, record):
        def spied(client, *args, **kwargs):
            record(client)
            return original(client, *args, **kwargs)
        return spied

    def _on_loop(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def _opened(self, _client) -> None:
        self.opened["loop" if self._on_loop() else "elsewhere"] += 1

    def _io(self, client) -> None:
        if self._on_loop():
            self.loop_io["non-blocking" if client._sock.gettimeout() == 0.0 else "blocking"] += 1


def outage_logs(caplog):
    records = [r for r in caplog.records if r.name == "lowcomm.telemetry"]
    return ([r for r in records if "unreachable" in r.getMessage()],
            [r for r in records if "is back" in r.getMessage()])


async def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_broker_killed_mid_run_loop_stays_responsive_and_reconnects(mosquitto_broker, caplog,
                                                                     monkeypatch):
    caplog.set_level(logging.INFO, logger="lowcomm.telemetry")
    status = node_status("12D3KooWoutage", "tele")
    threads = MqttThreads(monkeypatch)

    async def main():
        threads.loop_thread = threading.get_ident()
        pub = TelemetryPublisher(mosquitto_broker.url, "tele", "12D3KooWoutage",
                                 status.to_dict, interval=0.05, backoff_initial=0.05,
                                 backoff_max=0.2, timeout=2.0)
        pub.start()
        try:
            await asyncio.wait_for(pub.first_publish.wait(), 10)
            mosquitto_broker.kill()
            await asyncio.wait_for(pub.down.wait(), 10)
            attempts = pub.attempts
            await wait_until(lambda: pub.attempts >= attempts + 3, 10, "reconnect attempts")
            mosquitto_broker.start()
            await asyncio.wait_for(pub.connected.wait(), 10)
            published = pub.published
            status.update(round=6)
            await wait_until(lambda: pub.published > published, 10, "a publish after restart")
            _, doc = await retained(mosquitto_broker.url, pub.topic, lambda d: d["round"] == 6)
        finally:
            await pub.stop()
        return doc

    doc = asyncio.run(main())
    down, back = outage_logs(caplog)
    assert len(down) == 1 and len(back) == 1, [r.getMessage() for r in caplog.records]
    assert doc["online"] and doc["round"] == 6
    # the first connection, three failed ones and the one after the restart, all off the loop
    assert threads.opened["elsewhere"] >= 5 and not threads.opened["loop"], threads.opened
    assert threads.loop_io["non-blocking"] and not threads.loop_io["blocking"], threads.loop_io


def test_a_broker_that_accepts_but_never_answers_does_not_stall_the_loop(caplog, monkeypatch):
    """The nastiest outage: TCP connects, CONNACK never comes. Each retry must also give
    its socket back (aiomqtt leaves it open after a CONNACK timeout)."""
    caplog.set_level(logging.INFO, logger="lowcomm.telemetry")
    threads = MqttThreads(monkeypatch)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        url = f"mqtt://127.0.0.1:{mute.getsockname()[1]}"

        async def main():
            threads.loop_thread = threading.get_ident()
            pub = TelemetryPublisher(url, "tele", "12D3KooWmute", NodeStatus().to_dict,
                                     interval=0.05, backoff_initial=0.02, backoff_max=0.05,
                                     timeout=0.15)
            pub.start()
            try:
                await asyncio.wait_for(pub.down.wait(), 10)
                await wait_until(lambda: pub.attempts >= 3, 10, "three attempts")
                fds = len(os.listdir("/proc/self/fd"))
                await wait_until(lambda: pub.attempts >= 9, 10, "six more attempts")
                fds_later = len(os.listdir("/proc/self/fd"))
            finally:
                await asyncio.wait_for(pub.stop(), 10)  # a stop that hangs on the mute broker fails
            return fds_later - fds

        fd_growth = asyncio.run(main())
    down, back = outage_logs(caplog)
    assert len(down) == 1 and not back
    assert fd_growth <= 1, f"{fd_growth} file descriptors leaked over six retries"
    assert threads.opened["elsewhere"] >= 9 and not threads.opened["loop"], threads.opened
    assert not threads.loop_io["blocking"], threads.loop_io


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (cryptography, a dependency)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    span = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(hours=1))

    def cert(subject, issuer, public_key, signing_key, ca: bool, san=None):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(span[0]).not_valid_after(span[1])
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signing_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lowcomm test CA")])
    ca_cert = cert(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    server_cert = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]),
                       ca_name, server_key.public_key(), ca_key, False,
                       [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return paths


def test_mqtts_with_username_and_password(tmp_path, caplog):
    """mqtts://user:pass@host:port?ca=... against a mosquitto that demands both."""
    from tests.mqtt_broker import MosquittoBroker, require_mosquitto

    require_mosquitto()
    ca, cert, key = make_tls_files(tmp_path)
    passwd = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwd), "volunteer", "s3cret:/@"],
                   check=True, capture_output=True, timeout=30)
    broker = MosquittoBroker(tmp_path, listener_options=[
        f"cafile {ca}", f"certfile {cert}", f"keyfile {key}", "allow_anonymous false",
        f"password_file {passwd}"])
    broker.start()
    good = f"mqtts://volunteer:s3cret%3A%2F%40@127.0.0.1:{broker.port}?ca={ca}"
    bad = f"mqtts://volunteer:wrong@127.0.0.1:{broker.port}?ca={ca}"
    status = node_status("12D3KooWtls", "tls")

    async def main():
        ok = TelemetryPublisher(good, "tls", "12D3KooWtls", status.to_dict, interval=0.2)
        refused = TelemetryPublisher(bad, "tls", "12D3KooWbad", status.to_dict, interval=0.2,
                                     backoff_initial=0.05)
        ok.start()
        refused.start()
        try:
            await asyncio.wait_for(ok.first_publish.wait(), 10)
            await asyncio.wait_for(refused.down.wait(), 10)
            from node.ops.monitor import collect_swarm

            return (await collect_swarm(good, "tls")).docs(), refused.published
        finally:
            await ok.stop()
            await refused.stop()

    try:
        docs, refused_published = asyncio.run(main())
    finally:
        broker.stop()
    assert [d["peer_id"] for d in docs] == ["12D3KooWtls"] and refused_published == 0
    assert any("wrong" not in r.getMessage() and "unreachable" in r.getMessage()
               for r in caplog.records), "the refusal is logged, without the password"
