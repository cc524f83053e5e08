"""What runs beside the daemon's round loop for its operator, started and stopped together:
the control socket, the foreground status display, the usage sampler, MQTT telemetry and the
spot preemption watcher. The daemon plugs it in with a few lines:

    status = NodeStatus(peer_id=..., swarm=..., protocol=...)
    async with NodeOps.from_args(status, data_dir, args, on_preemption=stop.request):
        ...   # the daemon's work; it keeps `status` current (update / record_* methods)

Each part is also usable alone (node.ops.control, node.ops.telemetry, node.ops.preemption, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any, Callable

from rich.console import Console

from node.ops.control import ControlServer
from node.ops.preemption import PreemptionWatcher
from node.ops.status import NodeStatus
from node.ops.status_view import StatusDisplay
from node.ops.telemetry import TelemetryPublisher, parse_mqtt_url
from node.ops.usage import UsageSampler

log = logging.getLogger("lowcomm.ops")


class NodeOps:
    def __init__(self, status: NodeStatus, data_dir: str | os.PathLike, *,
                 mqtt_url: str | None = None, mqtt_interval: float = 5.0,
                 preemption: str | None = None, metadata_url: str | None = None,
                 preemption_interval: float = 5.0,
                 on_preemption: Callable[[str], Any] | None = None,
                 display: bool = True, console: Console | None = None,
                 sample_every: float = 2.0):
        self.status = status
        self.control = ControlServer(data_dir, status.to_dict)
        self.telemetry = None
        if mqtt_url:
            parse_mqtt_url(mqtt_url)  # a typo fails at start, not silently later
            self.telemetry = TelemetryPublisher(mqtt_url, status.swarm, status.peer_id,
                                                status.to_dict, interval=mqtt_interval)
        self.preemption = None
        if preemption:
            if on_preemption is None:
                raise ValueError("a preemption watcher needs on_preemption (the clean exit)")
            self.preemption = PreemptionWatcher(preemption, on_preemption,
                                                base_url=metadata_url,
                                                interval=preemption_interval)
        self.display = StatusDisplay(status.to_dict, console) if display else None
        self.sampler = UsageSampler(status.device)
        self.sample_every = sample_every
        self._tasks: list[asyncio.Task] = []
        self._saved_handlers: list[logging.Handler] | None = None

    @classmethod
    def from_args(cls, status: NodeStatus, data_dir: str | os.PathLike,
                  args: argparse.Namespace, **kwargs: Any) -> "NodeOps":
        """From the options of node.ops.cli.add_join_ops_arguments."""
        return cls(status, data_dir, mqtt_url=getattr(args, "mqtt", None),
                   mqtt_interval=getattr(args, "mqtt_interval", 5.0),
                   preemption=getattr(args, "preemption", None),
                   metadata_url=getattr(args, "metadata_url", None),
                   preemption_interval=getattr(args, "preemption_interval", 5.0), **kwargs)

    async def _sample(self) -> None:
        while True:
            self.status.update(**self.sampler.sample())
            await asyncio.sleep(self.sample_every)

    def _route_logs_above_the_view(self) -> None:
        """On a terminal, console log handlers would tear the live view: the root logger's
        stream handlers (not its file handlers) print through the view's console instead."""
        root = logging.getLogger()
        self._saved_handlers = list(root.handlers)
        keep = [h for h in root.handlers if type(h) is not logging.StreamHandler]
        level = min((h.level for h in root.handlers if h not in keep), default=logging.INFO)
        root.handlers[:] = [*keep, self.display.log_handler(level or logging.INFO)]

    async def start(self) -> None:
        await self.control.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._sample(), name="usage-sampler"))
        if self.display is not None:
            if self.display.console.is_terminal:
                self._route_logs_above_the_view()
            self._tasks.append(loop.create_task(self.display.run(), name="status-display"))
        if self.telemetry is not None:
            self.telemetry.start()
        if self.preemption is not None:
            self.preemption.start()

    async def stop(self) -> None:
        """Stops everything; telemetry says offline first. Never raises."""
        if self.preemption is not None:
            await self.preemption.stop()
        if self.telemetry is not None:
            await self.telemetry.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._saved_handlers is not None:
            logging.getLogger().handlers[:] = self._saved_handlers
            self._saved_handlers = None
        try:
            await self.control.stop()
        except OSError as exc:
            log.warning("could not remove the control socket: %s", exc)

    async def __aenter__(self) -> "NodeOps":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
