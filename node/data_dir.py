"""A node's data directory: its layout, spelled once, and the metrics log written in it.

    <data_dir>/identity.key      the Ed25519 key (p2p/identity.py), mode 0600
    <data_dir>/checkpoints/      node/train/checkpoint.py (the last two kept)
    <data_dir>/metrics.jsonl     every event of the node, one JSON object a line (node/events.py)
    <data_dir>/address           the daemon's listen addresses while it runs (for local tools)
    <data_dir>/control.sock      the daemon's control socket (node/ops/control.py)
    <data_dir>/node.log          the node's output, where a launcher (local-swarm) redirects it

Nothing else is needed to resume after a crash or a spot-instance preemption.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from node.events import Event


class DataDir:
    """The paths of one data directory (nothing is created here)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        self.metrics = self.root / "metrics.jsonl"
        self.address = self.root / "address"
        self.control_socket = self.root / "control.sock"
        self.log = self.root / "node.log"

    @property
    def identity(self) -> Path:
        from p2p.identity import identity_path  # hivemind loads slowly: only for who needs it
        return identity_path(self.root)


class MetricsLog:
    """Append-only JSON lines: one object per event, flushed so a SIGKILL loses at most one.
    An EventBus subscriber (every event)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def __call__(self, event: Event) -> None:
        self.file.write(json.dumps(event.record()) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
