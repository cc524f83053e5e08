"""The operator's commands: `lowcomm-node status` and `lowcomm-node monitor`, and the
`join` options for telemetry and preemption (`add_join_ops_arguments`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


def _data_dir(args: argparse.Namespace) -> Path:
    """--data-dir, else join's default for --swarm (runs/<id>), else the one daemon found
    under runs/."""
    if args.data_dir:
        return Path(args.data_dir)
    if args.swarm:
        return Path("runs") / args.swarm
    from node.ops.control import NoDaemonError, control_socket_path

    found = sorted(p for p in Path("runs").glob("*") if control_socket_path(p).exists())
    if len(found) == 1:
        return found[0]
    if not found:
        raise NoDaemonError("no lowcomm-node daemon found under runs/; give --data-dir DIR "
                            "or --swarm ID.")
    raise NoDaemonError(f"several daemons run under runs/ ({', '.join(map(str, found))}); "
                        f"choose one with --data-dir.")


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from node.ops.control import NoDaemonError, query_status
    from node.ops.status_view import StatusView

    data_dir = _data_dir(args)
    doc = query_status(data_dir)  # NoDaemonError (a RuntimeError) -> main prints it, exit 1
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    console = Console()
    if args.once or not console.is_terminal:
        console.print(StatusView(doc))
        return 0
    from rich.live import Live

    try:
        with Live(StatusView(doc), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    doc = query_status(data_dir)
                except NoDaemonError as exc:
                    live.stop()
                    print(f"lowcomm-node: the daemon went away: {exc}", file=sys.stderr)
                    return 1
                live.update(StatusView(doc), refresh=True)
    except KeyboardInterrupt:
        return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from node.ops.monitor import collect_swarm, run_monitor
    from node.ops.telemetry import parse_mqtt_url

    parse_mqtt_url(args.mqtt)  # a bad URL fails here, before anything connects
    if args.once:
        state = asyncio.run(collect_swarm(args.mqtt, args.swarm, timeout=args.timeout))
        if args.json:
            from node.ops.status import json_safe

            print(json.dumps(json_safe(state.summary()), indent=2, sort_keys=True))
        else:
            from rich.console import Console

            from node.ops.status_view import swarm_table

            Console().print(swarm_table(state.docs(), title=f"swarm {args.swarm}"))
        return 0
    if args.json:
        raise ValueError("--json prints one snapshot: use it with --once")
    try:
        asyncio.run(run_monitor(args.mqtt, args.swarm, refresh=args.interval))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from node.cli import _load_manifest
    from node.ops.doctor import DoctorOptions, run_and_report
    from node.ops.doctor_link import LinkOptions
    from p2p.host import check_peer_maddrs

    manifest = _load_manifest(args)
    options = DoctorOptions(Path(args.data_dir or f"runs/{manifest.swarm.id}"),
                            listen=args.listen or ["/ip4/0.0.0.0/tcp/0"],
                            peers=check_peer_maddrs(args.peer), reachability=args.reachability,
                            p2pd_timeout_s=args.p2pd_timeout,
                            link=LinkOptions(args.step_seconds, args.uplink_mbit, args.downlink_mbit,
                                             args.members))
    return run_and_report(manifest, options)


def _positive(text: str) -> float:
    value = float(text)
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def add_ops_commands(sub) -> None:
    doctor = sub.add_parser(
        "doctor", help="check that this machine can join a swarm (run it before `join`)",
        description="Check Python and torch, the device, the manifest, free disk for two "
                    "checkpoints, the bytes a round moves and the link rate they need, p2pd's "
                    "start, the bootstrap peers, this node's reachability "
                    "(public or behind NAT, with relay slots) and the clock against its peers. "
                    "One sentence per finding, with what to do; exit 0 only when the node can join.")
    doctor.add_argument("--swarm", metavar="ID", help="the swarm's id (configs/swarms/<ID>.toml)")
    doctor.add_argument("--manifest", metavar="PATH", type=Path, help="a manifest file instead")
    doctor.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[])
    doctor.add_argument("--peer", metavar="MULTIADDR", action="append", default=[],
                        help="a bootstrap peer besides the manifest's (repeatable)")
    doctor.add_argument("--listen", metavar="MULTIADDR", action="append", default=[],
                        help="where join will listen (default /ip4/0.0.0.0/tcp/0)")
    doctor.add_argument("--reachability", choices=("auto", "public", "private"), default="auto")
    doctor.add_argument("--data-dir", metavar="DIR", help="where join will keep checkpoints "
                        "(default runs/<swarm id>); nothing is written there")
    doctor.add_argument("--p2pd-timeout", type=float, default=15.0, metavar="S")
    doctor.add_argument("--step-seconds", type=_positive, metavar="S",
                        help="seconds a training step takes on this machine (default: estimated "
                             "by timing the model here); a round lasts inner_steps of them")
    doctor.add_argument("--uplink-mbit", type=_positive, metavar="MBIT",
                        help="this machine's upload rate, Mbit/s: judged against the round's bytes")
    doctor.add_argument("--downlink-mbit", type=_positive, metavar="MBIT",
                        help="this machine's download rate, Mbit/s")
    doctor.add_argument("--members", type=int, default=8, choices=range(2, 1 << 16), metavar="N",
                        help="the swarm's size the DiLoCoX bytes are sized for (default 8)")
    doctor.set_defaults(func=cmd_doctor)

    status = sub.add_parser(
        "status", help="show a running daemon's status (live), or print it once as JSON",
        description="Attach to the daemon running with this data directory (through its "
                    "owner-only control socket) and show its live status; Ctrl-C detaches.")
    status.add_argument("--data-dir", metavar="DIR",
                        help="the daemon's data directory (as given to join)")
    status.add_argument("--swarm", metavar="ID",
                        help="or the swarm id, for join's default data directory runs/<ID>; "
                        "with neither, the one daemon running under runs/")
    status.add_argument("--json", action="store_true",
                        help="print the status once as JSON (the schema of node/ops/status.py)")
    status.add_argument("--once", action="store_true", help="print the view once and exit")
    status.add_argument("--interval", type=float, default=1.0, metavar="S",
                        help="refresh period of the live view (default 1 s)")
    status.set_defaults(func=cmd_status)

    monitor = sub.add_parser(
        "monitor", help="watch a whole swarm through its MQTT telemetry",
        description="Subscribe to the swarm's telemetry and show one row per node, with "
                    "totals; stragglers (under half the median speed) are highlighted.")
    monitor.add_argument("--mqtt", required=True, metavar="URL",
                         help="broker: mqtt://[user:pass@]host[:port] or mqtts://... "
                         "(?ca=PATH for a private CA)")
    monitor.add_argument("--swarm", required=True, metavar="ID", help="the swarm id")
    monitor.add_argument("--once", action="store_true",
                         help="print one snapshot and exit (for scripts)")
    monitor.add_argument("--json", action="store_true", help="with --once: print JSON")
    monitor.add_argument("--timeout", type=float, default=5.0, metavar="S",
                         help="with --once: how long to wait for the broker (default 5 s)")
    monitor.add_argument("--interval", type=float, default=1.0, metavar="S",
                         help="refresh period of the live table (default 1 s)")
    monitor.set_defaults(func=cmd_monitor)


def add_join_ops_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `join` needs for telemetry and preemption; read back by node.ops."""
    from node.ops.preemption import PROVIDERS

    group = parser.add_argument_group("telemetry and preemption")
    group.add_argument("--mqtt", metavar="URL", default=os.environ.get("LOWCOMM_MQTT"),
                       help="publish status to this MQTT broker every few seconds "
                       "(mqtt://[user:pass@]host[:port] or mqtts://...; env LOWCOMM_MQTT)")
    group.add_argument("--mqtt-interval", type=float, default=5.0, metavar="S",
                       help="telemetry period in seconds (default 5)")
    group.add_argument("--preemption", choices=PROVIDERS,
                       default=os.environ.get("LOWCOMM_PREEMPTION") or None,
                       help="watch this cloud's spot/preemption notice and exit cleanly "
                       "before the instance is taken (env LOWCOMM_PREEMPTION)")
    group.add_argument("--metadata-url", metavar="URL",
                       help="the cloud metadata server (default: the provider's own)")
    group.add_argument("--preemption-interval", type=float, default=5.0, metavar="S",
                       help="how often to poll for a notice (default 5 s)")
