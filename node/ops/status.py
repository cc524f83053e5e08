"""The node's status: one object the daemon updates and every view reads.

`NodeStatus` is the documented telemetry schema. The same JSON (`to_dict()` / `to_json()`)
is served on the control socket (`lowcomm-node status --json`), published over MQTT to
`lowcomm/<swarm>/<peer>/status`, and drawn by the terminal view. Consumers must ignore keys
they do not know; a change that removes or re-means a key bumps `SCHEMA_VERSION`.

Fields, units and meaning (None = not known yet):

    schema                   int    schema version of this document (SCHEMA_VERSION)
    online                   bool   false only in the MQTT last will / the clean-exit message
    state                    str    starting | training | stopping | offline
    peer_id                  str    the node's libp2p peer id (base58; carries its public key)
    swarm                    str    swarm id (the manifest's name)
    protocol                 str    outer protocol: noloco | diloco | dilocox
    started_at               float  unix time (s) the daemon started
    updated_at               float  unix time (s) of the last update to any field
    seq                      int    status version: +1 on every update; two documents of one
                                    daemon run with the same seq hold the same numbers (the
                                    control socket's and the MQTT message's, say)
    round                    int    outer round (exchanges started since the run began)
    step                     int    inner optimizer step
    train_loss               float  latest training loss, nats/token
    val_loss                 float  latest validation loss, nats/token
    train_loss_trend         [float] last TREND_LEN training losses, oldest first
    val_loss_trend           [float] last TREND_LEN validation losses, oldest first
    tokens_per_second        float  inner training throughput of the last step, tokens/s
    rounds_per_minute        float  outer rounds completed per minute, averaged since start
    device                   str    where training runs: "cpu", "cuda:0", "mps"
    device_name              str    human name of the accelerator ("" on CPU)
    device_util_percent      float  accelerator utilisation, % (None on CPU or unknown)
    device_memory_bytes      int    accelerator memory in use by this process, bytes
    device_memory_total_bytes int   accelerator memory in total, bytes
    precision                str    the training precision and why: "bf16: compute capability
                                    9.0 has bf16 units (>= 8.0)", "fp32: a CPU trains in fp32"
    compute                  str    "compiled (train.compile = auto)" or "eager (<why>)"
    micro_batch              int    sequences per forward and backward on this device
    cpu_percent              float  this process's CPU use, % of one core (can pass 100)
    rss_bytes                int    this process's resident memory, bytes
    peers_known              int    swarm members seen on the DHT
    peers_alive              int    of those, seen alive recently (heartbeat not expired)
    partners                 [str]  peer ids of the current partner (NoLoCo) or group
    bytes_sent_round         int    bytes sent on the wire in the last finished round
    bytes_received_round     int    bytes received on the wire in the last finished round
    bytes_sent_total         int    bytes sent since the daemon started
    bytes_received_total     int    bytes received since the daemon started
    compression_ratio        float  raw fp32 bytes / wire bytes of the last exchanged payload
    compression              str    DiLoCoX's controller: its choice for the next round, one line
    refused                  {str: int} refused incoming messages by reason, since start
    last_exchange_at         float  unix time (s) of the last successful exchange
    pair_interval            int    NoLoCo: pairs once every this many rounds (1: every round;
                                    more where its swaps outlast its rounds)
    checkpoint_at            float  unix time (s) the newest checkpoint was written
    checkpoint_step          int    inner step of that checkpoint
    link                     str    where the link is too slow for the swarm's rounds as
                                    configured, one sentence with the numbers (measured by its
                                    exchanges); "" while it carries them or before it is measured
    reachability             str    one line: public, behind NAT (with its relay addresses) or
                                    local, and how the node found out
    streams_direct           int    streams opened to or from peers over direct connections
    streams_relayed          int    ... and through a circuit relay (members behind NAT)
    streams_forwarded        int    ... and forwarded by a public member (p2p/forwarding.py)
    forwarded_for_others     int    streams this node forwarded between two other members

Derived, added by `to_dict()` from the sender's own clock (so clock skew between machines
does not distort them): `last_exchange_age_s` and `checkpoint_age_s` (seconds, None when the
event never happened), and `uptime_s`.

Thread safety: the daemon's loop and its training thread may both call `update()`,
`record_train_loss()`, `record_val_loss()`, `count_refused()`; readers take `to_dict()`
(a consistent copy taken under the same lock).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
TREND_LEN = 32
STATES = ("starting", "training", "stopping", "offline")
DERIVED = ("last_exchange_age_s", "checkpoint_age_s", "uptime_s")


@dataclass
class NodeStatus:
    schema: int = SCHEMA_VERSION
    online: bool = True
    state: str = "starting"
    peer_id: str = ""
    swarm: str = ""
    protocol: str = ""
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    seq: int = 0
    round: int = 0
    step: int = 0
    train_loss: float | None = None
    val_loss: float | None = None
    train_loss_trend: list[float] = field(default_factory=list)
    val_loss_trend: list[float] = field(default_factory=list)
    tokens_per_second: float = 0.0
    rounds_per_minute: float = 0.0
    device: str = "cpu"
    device_name: str = ""
    device_util_percent: float | None = None
    device_memory_bytes: int | None = None
    device_memory_total_bytes: int | None = None
    precision: str = ""
    compute: str = ""
    micro_batch: int | None = None
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    peers_known: int = 0
    peers_alive: int = 0
    partners: list[str] = field(default_factory=list)
    bytes_sent_round: int = 0
    bytes_received_round: int = 0
    bytes_sent_total: int = 0
    bytes_received_total: int = 0
    compression_ratio: float | None = None
    compression: str | None = None
    refused: dict[str, int] = field(default_factory=dict)
    last_exchange_at: float | None = None
    pair_interval: int | None = None
    checkpoint_at: float | None = None
    checkpoint_step: int | None = None
    reachability: str = ""
    link: str = ""
    streams_direct: int = 0
    streams_relayed: int = 0
    streams_forwarded: int = 0
    forwarded_for_others: int = 0

    def __post_init__(self) -> None:
        # Not a dataclass field: it stays out of fields(), equality and the JSON.
        object.__setattr__(self, "_lock", threading.RLock())

    # ---- writers -------------------------------------------------------------------------
    def update(self, **values: Any) -> None:
        """Sets several fields at once (thread-safe); unknown names raise TypeError."""
        names = _FIELD_NAMES
        with self._lock:
            for name, value in values.items():
                if name not in names:
                    raise TypeError(f"NodeStatus has no field {name!r}")
                if name == "state" and value not in STATES:
                    raise ValueError(f"state {value!r} is not one of {', '.join(STATES)}")
                setattr(self, name, value)
            self._touch()

    def _touch(self, now: float | None = None) -> None:
        """Marks a change (under the lock): a new updated_at and the next seq."""
        self.updated_at = time.time() if now is None else now
        self.seq += 1

    def record_train_loss(self, loss: float) -> None:
        with self._lock:
            self.train_loss = float(loss)
            _push(self.train_loss_trend, float(loss))
            self._touch()

    def record_val_loss(self, loss: float) -> None:
        with self._lock:
            self.val_loss = float(loss)
            _push(self.val_loss_trend, float(loss))
            self._touch()

    def count_refused(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + n
            self._touch()

    def record_round(self, *, sent: int, received: int, raw_bytes: int | None = None,
                     exchanged: bool = True) -> None:
        """One finished round's traffic; `raw_bytes` (fp32 size of what was sent) gives the
        compression ratio; `exchanged` marks a successful exchange (now)."""
        with self._lock:
            self.bytes_sent_round, self.bytes_received_round = int(sent), int(received)
            self.bytes_sent_total += int(sent)
            self.bytes_received_total += int(received)
            if raw_bytes is not None and sent > 0:
                self.compression_ratio = raw_bytes / sent
            now = time.time()
            if exchanged:
                self.last_exchange_at = now
            self._touch(now)

    # ---- readers -------------------------------------------------------------------------
    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """A consistent JSON-ready copy, with the derived ages computed at `now`."""
        now = time.time() if now is None else now
        with self._lock:
            out = {f.name: _copy(getattr(self, f.name)) for f in _FIELDS}
        out["last_exchange_age_s"] = _age(now, out["last_exchange_at"])
        out["checkpoint_age_s"] = _age(now, out["checkpoint_at"])
        out["uptime_s"] = _age(now, out["started_at"])
        return out

    def to_json(self, now: float | None = None) -> str:
        # A diverged loss is NaN: JSON has no NaN, so non-finite numbers travel as null.
        return json.dumps(json_safe(self.to_dict(now)), separators=(",", ":"),
                          allow_nan=False, default=_json_default)

    def snapshot(self) -> "NodeStatus":
        return NodeStatus.from_dict(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NodeStatus":
        """Builds a status from a received document, ignoring keys it does not know (a newer
        sender) and keeping defaults for keys it lacks (an older one, or a last will)."""
        if not isinstance(data, dict):
            raise ValueError("a node status must be a JSON object")
        schema = data.get("schema", SCHEMA_VERSION)
        if not isinstance(schema, int) or schema < 1:
            raise ValueError(f"bad schema version {schema!r} in a node status")
        values = {k: v for k, v in data.items() if k in _FIELD_NAMES}
        return cls(**values)


def _push(trend: list[float], value: float) -> None:
    trend.append(value)
    del trend[:-TREND_LEN]


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else max(0.0, now - then)


def json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value


def _json_default(value: Any) -> Any:
    # numpy / torch scalars that slipped in through update()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


_FIELDS = dataclasses.fields(NodeStatus)
_FIELD_NAMES = frozenset(f.name for f in _FIELDS)


def offline_document(swarm: str, peer_id: str) -> dict[str, Any]:
    """What a node's MQTT last will (and its clean exit) says: it is gone."""
    return {"schema": SCHEMA_VERSION, "online": False, "state": "offline", "swarm": swarm,
            "peer_id": peer_id, "updated_at": time.time()}
