"""What one simulation runs: the protocol, its settings, and the exchange's latency and loss.

The model, data and inner optimizer come from the ordinary node config (node/config/schema.py); this is
everything on top. `validated()` refuses what does not fit with one sentence per problem, and
fills the settings a protocol leaves open with its documented defaults. NoLoCo and DiLoCoX run
the daemon's round classes, built from the manifest sections `sections()` makes of these
settings; `protocol_values` sets any other key of the manifest's [protocol] section (validated
as a manifest's), for what the named settings do not cover.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from node.config.manifest import WIRE_DTYPE_CHOICES, ContributionSection, ProtocolSection, \
    check_snapshot, check_topk
from node.config.schema import ConfigError, build_section
from protocol.diloco import DiLoCoHyperParameters

PROTOCOLS = ("data-parallel", "diloco", "noloco", "dilocox", "local")
TIMINGS = ("overlap", "blocking")
WIRE_DTYPES = WIRE_DTYPE_CHOICES  # bf16, fp16, fp32; int8, int4 quantized
SNAPSHOTS = ("theta", "phi_delta")
CODEC_PARAMETERS = {"lowrank": ("rank", "bits"), "blockwise": ("bits",), "topk": ("bits",)}
# the manifest key each codec parameter sets, where it is not the parameter's own name
MANIFEST_KEY = {("topk", "bits"): "topk_bits"}
# Every default of a simulation comes from here. NoLoCo's and DiLoCoX's are the swarm manifest's
# (node/config/manifest.py ProtocolSection: what a manifest that leaves a key out runs), so a
# simulation and a daemon on a default manifest run the same protocol. DiLoCo is no swarm
# protocol: its baseline takes the outer step measured best for it on our models
# (benchmarks/RESULTS.md, "DiLoCo's outer momentum"), not protocol/diloco.py's paper value, so
# that the first comparison a researcher runs is against a tuned baseline. Every method's H is
# the manifest's, so that methods run by default compare at equal H (for data-parallel and
# local training a round is only the interval between evaluations).
MANIFEST_DEFAULTS = ProtocolSection()
DILOCO_BASELINE = DiLoCoHyperParameters(outer_lr=0.7, momentum=0.6)
DEFAULT_INNER_STEPS = {protocol: MANIFEST_DEFAULTS.inner_steps for protocol in PROTOCOLS}


class SimulationError(ValueError):
    """The simulation cannot run as asked; the message says what to change."""


@dataclass
class SimulationSettings:
    protocol: str
    workers: int = 8
    inner_steps: int | None = None         # H; None: DEFAULT_INNER_STEPS[protocol]
    rounds: int = 6
    seed: int = 0
    eval_every: int = 1                    # evaluate every this many rounds (and the last)
    # the exchange
    latency_steps: int = 0                 # one message's travel time, in inner steps
    drop_probability: float = 0.0          # per point-to-point message (noloco, dilocox)
    # DiLoCo and DiLoCoX outer Nesterov; None: DILOCO_BASELINE or MANIFEST_DEFAULTS
    outer_lr: float | None = None
    outer_momentum: float | None = None
    # NoLoCo (docs/protocols.md §1 defaults)
    timing: str = MANIFEST_DEFAULTS.timing
    # the longest wait for a message (NoLoCo blocking: the partner's snapshot; DiLoCoX: the
    # group's messages of the round applied); None: H
    deadline_steps: int | None = None
    noloco_momentum: float = MANIFEST_DEFAULTS.momentum                    # α
    noloco_progress_weight: float = MANIFEST_DEFAULTS.progress_weight      # β
    noloco_consensus_weight: float = MANIFEST_DEFAULTS.consensus_weight    # γ
    wire_dtype: str = MANIFEST_DEFAULTS.wire_dtype  # of the snapshots sent
    # what a snapshot sends: "theta" or "phi_delta"; None: theta when β = γ, else phi_delta
    snapshot: str | None = None
    max_staleness: int = MANIFEST_DEFAULTS.max_staleness
    # DiLoCoX (docs/protocols.md §3); None: the manifest's default (MANIFEST_DEFAULTS)
    delay: int | None = None
    codec: str | None = None
    rank: int | None = None                # lowrank only
    bits: int | None = None                # lowrank, blockwise (bits) and topk (topk_bits)
    # any other key of the manifest's [protocol] section, e.g. {"fan_out": 4}
    protocol_values: dict[str, Any] = field(default_factory=dict)
    # any key of the manifest's [contributions] section, e.g. {"noise_ratio": 0.0}
    contribution_values: dict[str, Any] = field(default_factory=dict)

    @property
    def total_inner_steps(self) -> int:
        return self.rounds * self.inner_steps

    def codec_parameters(self) -> dict[str, int]:
        """The keyword arguments for get_codec(self.codec, ...)."""
        return {name: getattr(self, name) for name in CODEC_PARAMETERS.get(self.codec, ())
                if getattr(self, name) is not None}

    def codec_manifest_values(self) -> dict[str, int]:
        """`codec_parameters` under their manifest keys (ProtocolSection's fields)."""
        return {MANIFEST_KEY.get((self.codec, name), name): value
                for name, value in self.codec_parameters().items()}

    def validated(self) -> SimulationSettings:
        """A copy with defaults filled in; SimulationError on the first problem found."""
        s = dataclasses.replace(self)
        if s.protocol not in PROTOCOLS:
            raise SimulationError(f"protocol {s.protocol!r} is unknown: choose one of {', '.join(PROTOCOLS)}.")
        if s.inner_steps is None:
            s.inner_steps = DEFAULT_INNER_STEPS[s.protocol]
        outer = (DILOCO_BASELINE.outer_lr, DILOCO_BASELINE.momentum) if s.protocol == "diloco" \
            else (MANIFEST_DEFAULTS.outer_lr, MANIFEST_DEFAULTS.outer_momentum)
        for name, default in (("outer_lr", outer[0]), ("outer_momentum", outer[1]),
                              ("delay", MANIFEST_DEFAULTS.delay), ("codec", MANIFEST_DEFAULTS.codec)):
            if getattr(s, name) is None:
                setattr(s, name, default)
        if s.deadline_steps is None:
            s.deadline_steps = s.inner_steps
        for name, low in (("workers", 1), ("inner_steps", 1), ("rounds", 1), ("eval_every", 1),
                          ("latency_steps", 0), ("deadline_steps", 0), ("max_staleness", 0),
                          ("seed", 0)):
            value = getattr(s, name)
            if type(value) is not int or value < low:
                raise SimulationError(f"{name.replace('_', ' ')} must be a whole number >= {low}, got {value!r}.")
        if not 0.0 <= s.drop_probability < 1.0:
            raise SimulationError(f"drop probability must be in [0, 1), got {s.drop_probability}.")
        if s.drop_probability and s.protocol not in ("noloco", "dilocox"):
            raise SimulationError(f"{s.protocol} exchanges by a collective, which the simulator does "
                                  "not drop messages of: a drop probability applies to noloco and dilocox only.")
        if s.timing not in TIMINGS:
            raise SimulationError(f"timing {s.timing!r} is unknown: choose overlap or blocking.")
        if s.wire_dtype not in WIRE_DTYPES:
            raise SimulationError(f"wire dtype {s.wire_dtype!r} is unknown: choose one of "
                                  f"{', '.join(WIRE_DTYPES)}.")
        if s.snapshot is not None and s.snapshot not in SNAPSHOTS:
            raise SimulationError(f"snapshot {s.snapshot!r} is unknown: choose theta or phi_delta.")
        if s.delay not in (0, 1):
            raise SimulationError(f"DiLoCoX delay must be 0 or 1 rounds, got {s.delay!r}.")
        unused = [name for name in ("rank", "bits") if getattr(s, name) is not None
                  and name not in CODEC_PARAMETERS.get(s.codec, ())]
        if unused:
            raise SimulationError(f"codec {s.codec!r} takes no {unused[0]}: rank is for lowrank, "
                                  "bits for lowrank and blockwise.")
        try:
            s.sections()
        except ConfigError as exc:
            raise SimulationError(str(exc)) from None
        return s

    def sections(self) -> tuple[ProtocolSection, ContributionSection]:
        """The manifest sections the daemon's round classes are built from. Simulated time is
        counted in inner steps, so the deadlines (seconds in a manifest) are in steps here."""
        protocol = ProtocolSection(
            name=self.protocol if self.protocol in ("noloco", "dilocox") else "noloco",
            inner_steps=self.inner_steps, momentum=self.noloco_momentum,
            progress_weight=self.noloco_progress_weight,
            consensus_weight=self.noloco_consensus_weight, timing=self.timing,
            max_staleness=self.max_staleness, pair_deadline_s=float(self.deadline_steps),
            wire_dtype=self.wire_dtype, outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum, delay=self.delay, codec=self.codec,
            message_deadline_s=float(self.deadline_steps), **self.codec_manifest_values())
        if self.snapshot is not None:
            protocol.snapshot = self.snapshot
        build_section(ProtocolSection, self.protocol_values, "protocol.", protocol)
        if self.snapshot is None and "snapshot" not in self.protocol_values:
            # the documented default: θ alone where it is exact, both tensors where it is not
            equal = protocol.progress_weight == protocol.consensus_weight
            protocol.snapshot = "theta" if equal else "phi_delta"
        contributions = build_section(ContributionSection, self.contribution_values,
                                      "contributions.", ContributionSection())
        check_snapshot(protocol, contributions)
        check_topk(protocol)
        return protocol, contributions

    def describe(self) -> str:
        """One line naming the method as the results table shows it."""
        if self.protocol == "noloco":
            latency = f", swap takes {self.latency_steps} steps" if self.latency_steps else ""
            wire = self.protocol_values.get("wire_dtype", self.wire_dtype)
            wire = f", {wire} snapshots" if wire != MANIFEST_DEFAULTS.wire_dtype else ""
            return f"NoLoCo H={self.inner_steps} {self.timing}{latency}{wire}"
        if self.protocol == "dilocox":
            values = dict(self.codec_parameters())
            if self.codec == "topk":
                protocol, _ = self.validated().sections()
                values = {"k": protocol.topk_k, "chunk": protocol.topk_chunk, "bits": protocol.topk_bits}
            params = ", ".join(f"{k}={v}" for k, v in values.items())
            codec = f"{self.codec}({params})" if params else self.codec
            return f"DiLoCoX H={self.inner_steps} {codec} delay {self.delay}"
        if self.protocol == "diloco":
            return f"DiLoCo H={self.inner_steps}"
        return {"data-parallel": "data-parallel", "local": "local only"}[self.protocol]
