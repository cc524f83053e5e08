"""`lowcomm-node simulate`: N replicas of one protocol in this process; JSON, plot and table.

Imports stay light at module level (the CLI builds every subcommand's parser on each start);
torch and the simulator load in the handler.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Protocol-specific flags, and the protocols each one applies to: giving one to another
# protocol is refused, since it would silently do nothing.
APPLIES_TO = {
    "timing": ("noloco",), "deadline_steps": ("noloco", "dilocox"), "wire_dtype": ("noloco",),
    "snapshot": ("noloco",),
    "max_staleness": ("noloco",), "alpha": ("noloco",), "beta": ("noloco",), "gamma": ("noloco",),
    "delay": ("dilocox",), "codec": ("dilocox",), "rank": ("dilocox",), "bits": ("dilocox",),
    "outer_lr": ("diloco", "dilocox"), "outer_momentum": ("diloco", "dilocox"),
    "drop_probability": ("noloco", "dilocox"),
}
SETTING_OF_FLAG = {"alpha": "noloco_momentum", "beta": "noloco_progress_weight",
                   "gamma": "noloco_consensus_weight"}


def add_simulate_command(subparsers) -> argparse.ArgumentParser:
    from node.simulator.settings import (DEFAULT_INNER_STEPS, DILOCO_BASELINE, MANIFEST_DEFAULTS,
                                         PROTOCOLS, TIMINGS, WIRE_DTYPES)

    d = MANIFEST_DEFAULTS  # every default below: the swarm manifest's, DiLoCo's baseline apart

    p = subparsers.add_parser(
        "simulate", help="train N replicas in this process with one protocol (no network)",
        description="Train N replicas in this process, exchanging through memory with the same "
                    "protocol code the daemon runs; write per-round metrics (JSON), a plot of "
                    "validation loss against tokens (PNG) and print a table.")
    p.add_argument("--protocol", required=True, choices=PROTOCOLS)
    p.add_argument("--workers", type=int, default=8, metavar="N", help="replicas (default 8)")
    p.add_argument("-H", "--inner-steps", type=int, metavar="H",
                   help=f"inner steps per round (default {DEFAULT_INNER_STEPS['noloco']}, the "
                   "manifest's, for every protocol)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="inner steps per replica in all, a multiple of "
                        "H (default: train.steps of the config)")
    length.add_argument("--rounds", type=int, help="rounds to run (instead of --steps)")
    p.add_argument("--eval-every", type=int, default=1, metavar="ROUNDS",
                   help="validate every this many rounds, and after the last (default 1)")
    net = p.add_argument_group("the simulated exchange")
    latency = net.add_mutually_exclusive_group()
    latency.add_argument("--latency-steps", type=int, metavar="STEPS",
                         help="one message's travel time in inner steps (default 0)")
    latency.add_argument("--latency-rounds", type=float, metavar="ROUNDS",
                         help="one message's travel time in rounds of H steps")
    net.add_argument("--drop-probability", type=float, metavar="P",
                     help="chance that a point-to-point message is lost (noloco, dilocox)")
    net.add_argument("--deadline-steps", type=int, help="the longest wait for a message, in "
                     "inner steps (noloco blocking: the partner's snapshot; dilocox: the "
                     "group's messages; default H)")
    outer = p.add_argument_group("DiLoCo and DiLoCoX outer Nesterov")
    outer.add_argument("--outer-lr", type=float, help=f"η (default: diloco "
                       f"{DILOCO_BASELINE.outer_lr}, dilocox {d.outer_lr})")
    outer.add_argument("--outer-momentum", type=float, help=f"μ (default: diloco "
                       f"{DILOCO_BASELINE.momentum}, its best measured; dilocox {d.outer_momentum})")
    noloco = p.add_argument_group("NoLoCo")
    noloco.add_argument("--timing", choices=TIMINGS, help=f"overlap or blocking (default {d.timing})")
    noloco.add_argument("--alpha", type=float, help=f"outer momentum α (default {d.momentum})")
    noloco.add_argument("--beta", type=float, help=f"progress weight β (default {d.progress_weight})")
    noloco.add_argument("--gamma", type=float, help=f"consensus weight γ (default {d.consensus_weight})")
    noloco.add_argument("--wire-dtype", choices=WIRE_DTYPES,
                        help=f"how the snapshots travel (default {d.wire_dtype}; int4 and "
                        "int8: quantized in blocks of 64, about 0.5 and 1 bytes a parameter; "
                        "their rounding: --set protocol.wire_rounding=stochastic|nearest)")
    noloco.add_argument("--snapshot", choices=("theta", "phi_delta"),
                        help="what a snapshot sends: the fast weights θ alone (default when "
                        "β = γ; half the bytes) or φ and Δ (default, and needed, when β ≠ γ)")
    noloco.add_argument("--max-staleness", type=int, help="largest round difference of a pair "
                        f"(default {d.max_staleness})")
    dilocox = p.add_argument_group("DiLoCoX")
    dilocox.add_argument("--delay", type=int, choices=(0, 1), help="rounds between sending and "
                         f"applying the pseudo-gradients (default {d.delay})")
    dilocox.add_argument("--codec", help="pseudo-gradient codec: lowrank, topk, blockwise, bf16, "
                         f"fp16, identity (default {d.codec})")
    dilocox.add_argument("--rank", type=int, help=f"lowrank: rank k (default {d.rank})")
    dilocox.add_argument("--bits", type=int, choices=(2, 4, 8), help="lowrank, blockwise: bits "
                         f"(4 or 8, default {d.bits}); topk: bits per value (default {d.topk_bits})")
    cfg = p.add_argument_group("model, data and inner optimizer (the node config)")
    cfg.add_argument("--model", metavar="PRESET", help="model preset in configs/models/ (default tiny)")
    cfg.add_argument("--config", type=Path, metavar="PATH", help="a node config TOML file")
    cfg.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one config value, e.g. --set model.dim=64, or a key of the "
                     "manifest's [protocol] section, e.g. --set protocol.fan_out=4 (repeatable)")
    cfg.add_argument("--seed", type=int, default=0, help="seed of weights, streams, pairs and losses")
    cfg.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory "
                   "(default runs/simulate/PROTOCOL-N)")
    p.set_defaults(func=cmd_simulate)
    return p


def settings_from_args(args: argparse.Namespace, default_steps: int,
                       protocol_values: dict | None = None):
    """SimulationSettings from the parsed flags; SimulationError names a misplaced flag."""
    from node.simulator.settings import DEFAULT_INNER_STEPS, SimulationError, SimulationSettings

    given = {flag: value for flag in APPLIES_TO if (value := getattr(args, flag)) is not None}
    for flag in given:
        if args.protocol not in APPLIES_TO[flag]:
            raise SimulationError(f"--{flag.replace('_', '-')} does not apply to {args.protocol}: "
                                  f"it is for {' and '.join(APPLIES_TO[flag])}.")
    inner_steps = args.inner_steps or DEFAULT_INNER_STEPS[args.protocol]
    if args.rounds is not None:
        rounds = args.rounds
    else:
        steps = args.steps if args.steps is not None else default_steps
        if steps % inner_steps or steps < inner_steps:
            raise SimulationError(f"--steps {steps} is not a whole number of rounds of H = "
                                  f"{inner_steps}: use a multiple of {inner_steps}, or --rounds.")
        rounds = steps // inner_steps
    latency = args.latency_steps if args.latency_steps is not None else 0
    if args.latency_rounds is not None:
        latency = round(args.latency_rounds * inner_steps)
    values = {SETTING_OF_FLAG.get(flag, flag): value for flag, value in given.items()}
    return SimulationSettings(protocol=args.protocol, workers=args.workers,
                              inner_steps=inner_steps, rounds=rounds, seed=args.seed,
                              eval_every=args.eval_every, latency_steps=latency,
                              protocol_values=protocol_values or {}, **values).validated()


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from node.config.schema import load_config, nest_overrides, parse_override
    from node.simulator.report import human_bytes, plot_validation_loss, round_table, write_json
    from node.simulator.runner import run_simulation

    protocol = [o for o in args.overrides if o.strip().startswith("protocol.")]
    overrides = [o for o in args.overrides if o not in protocol]
    if args.model:
        overrides.insert(0, f"model.preset={json.dumps(args.model)}")
    if args.threads is not None:
        overrides.append(f"train.threads={args.threads}")
    config = load_config(args.config, overrides)
    protocol_values = nest_overrides([parse_override(o) for o in protocol]).get("protocol", {})
    settings = settings_from_args(args, config.train.steps, protocol_values)
    out = args.out or Path("runs/simulate") / f"{settings.protocol}-{settings.workers}"
    console = Console()
    if not console.is_terminal:  # a pipe or a log: do not squeeze the table into 80 columns
        console = Console(width=140)
    console.print(f"simulating {settings.describe()} with {settings.workers} replicas, "
                  f"{settings.rounds} rounds of {settings.inner_steps} steps")

    def progress(record) -> None:
        loss = f"{record.val_loss_mean:.4f}" if record.val_loss_mean is not None else "-"
        console.print(f"round {record.round}/{settings.rounds}: val loss {loss}, sent "
                      f"{human_bytes(record.bytes_sent_per_replica)}/replica, "
                      f"{record.wall_seconds:.0f} s")

    result = run_simulation(settings, config, on_round=progress)
    json_path = write_json(result, out / "metrics.json")
    png_path = plot_validation_loss([result], out / "validation_loss.png",
                                    f"{result.method}, {settings.workers} replicas")
    console.print(round_table(result))
    console.print(f"wrote {json_path} and {png_path}")
    return 0
