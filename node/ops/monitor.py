"""`lowcomm-node monitor`: the whole swarm from its MQTT telemetry.

Subscribes to `lowcomm/<swarm>/+/status` and keeps the newest document of every node. A last
will (online false) keeps the node's last known numbers and marks it offline.

- `collect_swarm(url, swarm)`: one snapshot, for `--once` and scripts. After subscribing it
  sends itself a marker on a private topic: the broker delivers the retained statuses before
  it, so the snapshot is complete without guessing a wait.
- `watch_swarm(...)`: the live view; reconnects with backoff like the publisher.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from typing import Any, Callable

import aiomqtt
from rich.console import Console
from rich.live import Live

from node.ops.status_view import stragglers, swarm_table, swarm_totals
from node.ops.telemetry import (TOPIC_ROOT, MqttTarget, close_quietly, parse_mqtt_url,
                            swarm_filter)

log = logging.getLogger("lowcomm.monitor")


class SwarmState:
    """The newest status of every node of one swarm, keyed by peer id."""

    def __init__(self, swarm: str):
        self.swarm = swarm
        self.nodes: dict[str, dict[str, Any]] = {}
        self.bad_messages = 0

    def receive(self, topic: str, payload: bytes) -> str | None:
        """Takes one message; returns the peer it was about, or None if it was not a status."""
        levels = topic.split("/")
        if len(levels) != 4 or levels[0] != TOPIC_ROOT or levels[3] != "status":
            return None
        peer = levels[2]
        if not payload:  # a cleared retained message: the node was removed
            self.nodes.pop(peer, None)
            return peer
        try:
            doc = json.loads(payload)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
        except ValueError:
            self.bad_messages += 1
            return None
        doc.setdefault("peer_id", peer)
        doc["received_at"] = time.time()
        if not doc.get("online", True) and peer in self.nodes:
            merged = dict(self.nodes[peer])  # keep the last numbers, mark it gone
            merged.update(online=False, state="offline", received_at=doc["received_at"])
            doc = merged
        self.nodes[peer] = doc
        return peer

    def docs(self) -> list[dict[str, Any]]:
        return sorted(self.nodes.values(), key=lambda d: d.get("peer_id", ""))

    def summary(self) -> dict[str, Any]:
        docs = self.docs()
        return {"swarm": self.swarm, "nodes": docs, "totals": swarm_totals(docs),
                "stragglers": sorted(stragglers(docs))}


def _target(url: str | MqttTarget) -> MqttTarget:
    return url if isinstance(url, MqttTarget) else parse_mqtt_url(url)


async def collect_swarm(url: str | MqttTarget, swarm: str,
                        timeout: float = 5.0) -> SwarmState:
    """Every node's retained status, once. Raises ConnectionError if the broker is away."""
    target, state = _target(url), SwarmState(swarm)
    marker_topic = f"{TOPIC_ROOT}/{swarm}/_monitor/{os.getpid()}-{random.getrandbits(48):x}"
    try:
        async with target.client(timeout=timeout) as client:
            await client.subscribe(swarm_filter(swarm), qos=0)
            await client.subscribe(marker_topic, qos=0)
            await client.publish(marker_topic, b"sync", qos=0)

            async def drain() -> None:
                async for message in client.messages:
                    topic = str(message.topic)
                    if topic == marker_topic:
                        return
                    state.receive(topic, bytes(message.payload or b""))

            try:
                await asyncio.wait_for(drain(), timeout)
            except asyncio.TimeoutError:
                log.warning("the broker did not echo the monitor's marker in %gs; the "
                            "snapshot may be incomplete", timeout)
    except aiomqtt.MqttError as exc:
        raise ConnectionError(f"cannot read swarm {swarm!r} from the MQTT broker "
                              f"{target.display()}: {exc}") from None
    return state


async def watch_swarm(url: str | MqttTarget, swarm: str, on_change: Callable[[], None],
                      state: SwarmState, backoff_max: float = 30.0) -> None:
    """Keeps `state` current until cancelled, reconnecting with backoff."""
    target, backoff, down = _target(url), 1.0, False
    while True:
        client = target.client()
        try:
            async with client:
                if down:
                    log.warning("MQTT broker %s is back", target.display())
                down, backoff = False, 1.0
                await client.subscribe(swarm_filter(swarm), qos=0)
                async for message in client.messages:
                    if state.receive(str(message.topic), bytes(message.payload or b"")):
                        on_change()
        except aiomqtt.MqttError as exc:
            close_quietly(client)
            if not down:
                log.warning("MQTT broker %s unreachable (%s); retrying", target.display(), exc)
                down = True
        await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
        backoff = min(backoff * 2, backoff_max)


async def run_monitor(url: str, swarm: str, console: Console | None = None,
                      refresh: float = 1.0, plain_every: float = 10.0) -> None:
    """The live swarm table until Ctrl-C; on a non-terminal, the table every `plain_every` s."""
    console = console or Console()
    state = SwarmState(swarm)
    title = f"swarm {swarm} via {_target(url).display()}"
    watcher = asyncio.create_task(watch_swarm(url, swarm, lambda: None, state))
    try:
        if console.is_terminal:
            with Live(swarm_table([], title=title), console=console, auto_refresh=False) as live:
                while True:
                    live.update(swarm_table(state.docs(), title=title), refresh=True)
                    await asyncio.sleep(refresh)
        await asyncio.sleep(refresh)  # the retained statuses arrive at once
        while True:
            console.print(swarm_table(state.docs(), title=title))
            await asyncio.sleep(plain_every)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
