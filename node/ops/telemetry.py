"""MQTT telemetry: a node publishes its status, retained, to `lowcomm/<swarm>/<peer>/status`.

    publisher = TelemetryPublisher("mqtt://user:pass@host:1883", swarm, peer_id, status.to_dict)
    publisher.start()          # an asyncio task in the daemon's loop
    ...
    await publisher.stop()     # publishes the offline document, disconnects cleanly

Every `interval` seconds the JSON of `get_status()` (the NodeStatus schema, see node/ops/status.py)
is published with QoS 1 and the retain flag, so a monitor that connects later sees every node
at once. The connection carries a last will (the offline document, retained): when the node
dies without saying goodbye the broker marks it offline.

A broker that is down or unreachable never slows or stops training: the publisher lives in the
event loop, never blocks it (aiomqtt runs the blocking connect in a thread), and retries with
exponential backoff and jitter. It says so once: one warning when the broker goes away, one
line when it is back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

import aiomqtt

from node.ops.status import json_safe, offline_document

log = logging.getLogger("lowcomm.telemetry")
TOPIC_ROOT = "lowcomm"
DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


class MqttUrlError(ValueError):
    pass


@dataclass(frozen=True)
class MqttTarget:
    """Where to publish: parsed from mqtt[s]://[user[:password]@]host[:port][?ca=PATH]."""
    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None

    def display(self) -> str:
        """The URL without the password, fit for logs."""
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{host}:{self.port}"

    def client(self, **kwargs: Any) -> aiomqtt.Client:
        tls = None
        if self.tls:
            tls = aiomqtt.TLSParameters(ca_certs=self.ca_file, cert_reqs=ssl.CERT_REQUIRED,
                                        tls_version=ssl.PROTOCOL_TLS_CLIENT)
        return aiomqtt.Client(self.host, self.port, username=self.username,
                              password=self.password, tls_params=tls, **kwargs)


def parse_mqtt_url(url: str) -> MqttTarget:
    """Parses a broker URL, with errors that say what to write instead."""
    hint = "write it as mqtt://[user:password@]host[:port] or mqtts://... for TLS"
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise MqttUrlError(f"bad MQTT URL {url!r}: {exc}; {hint}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise MqttUrlError(f"MQTT URL {url!r} has scheme {parts.scheme or 'none'!r}; {hint}")
    if not parts.hostname:
        raise MqttUrlError(f"MQTT URL {url!r} names no host; {hint}")
    if parts.path not in ("", "/") or parts.fragment:
        raise MqttUrlError(f"MQTT URL {url!r} has a path; a broker URL has none ({hint})")
    query = urllib.parse.parse_qs(parts.query)
    unknown = set(query) - {"ca"}
    if unknown:
        raise MqttUrlError(f"MQTT URL {url!r}: unknown option {sorted(unknown)[0]!r} "
                           f"(the only option is ?ca=PATH, a CA bundle for mqtts)")
    if "ca" in query and scheme != "mqtts":
        raise MqttUrlError(f"MQTT URL {url!r}: ?ca= only makes sense with mqtts://")
    unquote = urllib.parse.unquote
    return MqttTarget(
        host=parts.hostname, port=port or DEFAULT_PORTS[scheme], tls=scheme == "mqtts",
        username=unquote(parts.username) if parts.username is not None else None,
        password=unquote(parts.password) if parts.password is not None else None,
        ca_file=query["ca"][-1] if "ca" in query else None)


def _check_level(kind: str, value: str) -> str:
    if not value or any(c in value for c in "/+#\0"):
        raise ValueError(f"{kind} {value!r} cannot be an MQTT topic level "
                         f"(empty, or contains / + # or NUL)")
    return value


def status_topic(swarm: str, peer_id: str) -> str:
    return f"{TOPIC_ROOT}/{_check_level('swarm id', swarm)}/{_check_level('peer id', peer_id)}" \
           f"/status"


def swarm_filter(swarm: str) -> str:
    return f"{TOPIC_ROOT}/{_check_level('swarm id', swarm)}/+/status"


def close_quietly(client: aiomqtt.Client) -> None:
    """Frees the socket of a client whose connect timed out half-way (TCP up, no CONNACK):
    aiomqtt leaves it open, and a hung broker would otherwise cost one fd per retry."""
    paho = getattr(client, "_client", None)
    try:
        if hasattr(paho, "_reset_sockets"):
            paho._reset_sockets()
        elif paho is not None and paho.socket() is not None:
            paho.socket().close()
    except Exception:  # best effort: the client is being thrown away anyway
        pass


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(json_safe(doc), separators=(",", ":"), allow_nan=False,
                      default=str).encode()


class TelemetryPublisher:
    def __init__(self, url: str | MqttTarget, swarm: str, peer_id: str,
                 get_status: Callable[[], dict[str, Any]], *, interval: float = 5.0,
                 backoff_initial: float = 1.0, backoff_max: float = 60.0,
                 timeout: float = 10.0, logger: logging.Logger | None = None):
        self.target = url if isinstance(url, MqttTarget) else parse_mqtt_url(url)
        self.swarm, self.peer_id = swarm, peer_id
        self.topic = status_topic(swarm, peer_id)
        self.get_status = get_status
        self.interval, self.timeout = interval, timeout
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.log = logger or log
        self.published = 0
        self.attempts = 0       # connection attempts, for tests and diagnostics
        # Observable state, for tests and the status view: set while connected / while down.
        self.connected = asyncio.Event()
        self.down = asyncio.Event()
        self.first_publish = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._down_since: float | None = None
        self._getter_failed = False

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(),
                                                                name="mqtt-telemetry")
        return self._task

    async def stop(self, timeout: float = 5.0) -> None:
        """Says goodbye (offline, retained) when connected, then ends the task."""
        self._stop.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        except Exception:  # run() logs its own failures
            pass

    async def _wait_stop(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    def _payload(self) -> bytes | None:
        try:
            doc = dict(self.get_status())
        except Exception:
            if not self._getter_failed:
                self.log.exception("MQTT telemetry: reading the node status failed")
                self._getter_failed = True
            return None
        self._getter_failed = False
        doc["online"] = True
        return encode(doc)

    def _went_down(self, exc: BaseException) -> None:
        self.connected.clear()
        if not self.down.is_set():
            self.down.set()
            self._down_since = time.monotonic()
            self.log.warning("MQTT telemetry: broker %s unreachable (%s); training goes on, "
                             "retrying with backoff up to %gs", self.target.display(),
                             exc or type(exc).__name__, self.backoff_max)

    def _came_up(self) -> None:
        self.connected.set()
        if self.down.is_set():
            self.down.clear()
            self.log.warning("MQTT telemetry: broker %s is back after %.0fs; publishing again",
                             self.target.display(), time.monotonic() - self._down_since)
        elif self.published == 0:
            self.log.info("MQTT telemetry: publishing to %s topic %s every %gs",
                          self.target.display(), self.topic, self.interval)

    async def run(self) -> None:
        will = aiomqtt.Will(self.topic, encode(offline_document(self.swarm, self.peer_id)),
                            qos=1, retain=True)
        backoff = self.backoff_initial
        while not self._stop.is_set():
            self.attempts += 1
            client = self.target.client(will=will, timeout=self.timeout,
                                        keepalive=max(10, int(self.interval * 4)))
            try:
                async with client as c:
                    self._came_up()
                    backoff = self.backoff_initial
                    while not self._stop.is_set():
                        payload = self._payload()
                        if payload is not None:
                            await c.publish(self.topic, payload, qos=1, retain=True)
                            self.published += 1
                            self.first_publish.set()
                        if await self._wait_stop(self.interval):
                            break
                    offline = encode(offline_document(self.swarm, self.peer_id))
                    await c.publish(self.topic, offline, qos=1, retain=True,
                                    timeout=min(self.timeout, 2.0))
                    self.connected.clear()
                    return
            except aiomqtt.MqttError as exc:
                close_quietly(client)
                self._went_down(exc)
            # jitter keeps a swarm that lost its broker from reconnecting all at once
            if await self._wait_stop(backoff * random.uniform(0.8, 1.2)):
                break
            backoff = min(backoff * 2, self.backoff_max)
        self.connected.clear()
