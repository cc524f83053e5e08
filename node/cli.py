"""`lowcomm-node`: the command line. Each subcommand parses, validates, then hands off."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from p2p.errors import P2PError
from node.config.schema import CONFIG_DIR, ConfigError, describe, load_config, to_toml
from node.config.settings import NODE_PREFIX

EXIT_USAGE = 2


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", type=Path,
                        help="a TOML config file (see configs/); defaults apply to what it omits")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                        default=[], help="override one config value, e.g. --set train.steps=600 "
                        "(TOML syntax; repeatable). `lowcomm-node config --keys` lists the keys")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="the node's data directory (identity, checkpoints, logs); "
                        "same as --set node.data_dir=DIR")


def _load(args: argparse.Namespace):
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"node.data_dir={json.dumps(args.data_dir)}")
    return load_config(args.config, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from node.train.standalone import StopFlag, run_training
    from node.ops.train_display import TrainDisplay
    from p2p.identity import NodeIdentity, identity_path

    # The batch stream is seeded by the node's public key: two volunteers never share one.
    identity = NodeIdentity.load_or_create(identity_path(cfg.node.data_dir)).public_key_bytes
    stop = StopFlag()
    stop.install()
    with TrainDisplay(cfg.train.log_every) as display:
        run_training(cfg, identity, [display], stop)
    return 0


def _load_manifest(args: argparse.Namespace):
    from node.config.manifest import find_manifest, load_manifest
    if not args.swarm and not args.manifest and getattr(args, "swarm_default", None):
        args.swarm = args.swarm_default
    if bool(args.swarm) == bool(args.manifest):
        raise ConfigError("give exactly one of --swarm ID (a manifest in configs/swarms/) or "
                          "--manifest PATH")
    path = args.manifest if args.manifest else find_manifest(args.swarm)
    from node.config.schema import nest_overrides, parse_override
    return load_manifest(path, nest_overrides([parse_override(o) for o in args.overrides
                                               if not o.startswith(NODE_PREFIX)]))


def _multiaddr(text: str, option: str) -> str:
    from hivemind.utils.multiaddr import Multiaddr  # hivemind's vendored copy
    try:
        return str(Multiaddr(text))
    except Exception:
        raise ConfigError(f"{option} {text!r} is not a multiaddr: write it like "
                          f"/ip4/203.0.113.7/tcp/31337") from None


def _gpu_overrides(gpu: int | None, overrides: list[str]) -> list[str]:
    """`--gpu N`: train.device = cuda:N, checked against this machine's GPUs before anything
    starts; ValueError in one sentence for one it lacks or a train.device also given."""
    if gpu is None:
        return []
    if any(o.replace(" ", "").startswith("train.device=") for o in overrides):
        raise ConfigError(f"--gpu {gpu} and --set train.device both choose the device: give one")
    import torch

    from node.train.accelerator import gpu_device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f'train.device="{gpu_device(gpu, count, f"--gpu {gpu}")}"']


def cmd_join(args: argparse.Namespace) -> int:
    args.overrides += _gpu_overrides(args.gpu, args.overrides)
    manifest = _load_manifest(args)
    import logging

    from node.config.settings import NodeSettings, apply_node_settings
    from node.daemon.daemon import Daemon
    from p2p.host import check_peer_maddrs, run_event_loop

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ops = {"mqtt_url": args.mqtt, "mqtt_interval": args.mqtt_interval,
           "preemption": args.preemption, "metadata_url": args.metadata_url,
           "preemption_interval": args.preemption_interval}
    settings = NodeSettings(Path(args.data_dir or f"runs/{manifest.swarm.id}"),
                            listen=args.listen or ["/ip4/0.0.0.0/tcp/0"],
                            announce=[_multiaddr(a, "--announce") for a in args.announce],
                            peers=check_peer_maddrs(args.peer), grace_s=args.grace,
                            max_steps=args.max_steps, port_mapping=args.port_mapping, ops=ops,
                            min_peers=args.min_peers, reachability=args.reachability,
                            relays=check_peer_maddrs(args.relay, "--relay"),
                            round_end=args.round_end)
    if args.round_end == "beside" and manifest.protocol.name != "dilocox":
        raise ConfigError(f"--round-end beside is for DiLoCoX swarms, and {manifest.swarm.id} runs "
                         f"{manifest.protocol.name}: leave it out (NoLoCo's round end runs on the "
                         f"training device)")
    settings.timeouts.p2pd_start_s = args.p2pd_timeout
    from node.config.schema import parse_override
    apply_node_settings(settings, [parse_override(o) for o in args.overrides if o.startswith(NODE_PREFIX)])
    return run_event_loop(Daemon(manifest, settings).run())


def cmd_local_swarm(args: argparse.Namespace) -> int:
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes = {args.nodes} is out of range: it must be >= 1")
    from node.ops.local_swarm import gpu_arguments, run_local_swarm
    node_args = gpu_arguments(args.gpus, args.nodes)  # checked before any process starts
    args.nodes = len(node_args)
    manifest = _load_manifest(args)  # validated here, once, before any process starts
    join_args = ["--swarm", args.swarm] if args.swarm else ["--manifest", str(args.manifest)]
    for override in args.overrides:
        join_args += ["--set", override]
    if not any(o.startswith("train.threads") for o in args.overrides):
        # N nodes share this machine: oversubscribed torch threads spin and slow everyone
        join_args += ["--set", f"train.threads={max(1, (os.cpu_count() or 1) // args.nodes)}"]
    if args.max_steps:
        join_args += ["--max-steps", str(args.max_steps)]
    base = Path(args.base_dir or f"runs/local-{manifest.swarm.id}")
    return run_local_swarm(args.nodes, base, join_args, grace_s=args.grace, node_args=node_args)


def cmd_init_swarm(args: argparse.Namespace) -> int:
    from node.config.schema import nest_overrides, parse_override
    from node.config.manifest import SWARM_DIR, Manifest, manifest_from_dict, write_manifest
    values = {"swarm": {"id": args.id, "description": args.description},
              "model": args.model, "protocol": {"name": args.protocol},
              "network": {"bootstrap_peers": args.bootstrap},
              "admission": {"mode": "allowlist" if args.allow else "open",
                            "public_keys": args.allow}}
    if args.data:
        from node.data.shards import pinned_data_settings
        values["data"] = pinned_data_settings(Path(args.data))
    manifest = manifest_from_dict(values)
    if args.overrides:
        from node.config.schema import build_config
        manifest = build_config([manifest.to_dict(), nest_overrides([parse_override(o) for o in args.overrides])],
                                Manifest)
    path = Path(args.out) if args.out else SWARM_DIR / f"{args.id}.toml"
    if path.exists() and not args.force:
        raise ConfigError(f"{path} exists: choose another --id or --out, or pass --force")
    write_manifest(manifest, path)
    print(f"wrote {path} (digest {manifest.digest}); members join with "
          f"`lowcomm-node join --manifest {path}`")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        for key, type_name, default, help_text in describe():
            print(f"{key:26} {type_name:14} default {default!r:10}  {help_text}")
        return 0
    print(to_toml(_load(args).to_dict()), end="")
    return 0


# the swarm-wide bounds of its exchanges, in the manifest's protocol section (node/config/manifest.py)
SWARM_TIMING = ("pair_deadline_s", "max_swap_rounds", "message_deadline_s", "min_link_mbit_s")


def cmd_settings(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from node.config.manifest import ProtocolSection
    from node.config.settings import node_settings
    print("This node's settings (lowcomm-node join --set node.<name>=<value>):")
    for key, type_name, default, meaning in node_settings():
        print(f"  {key:34} {type_name:6} default {default!r:12} {meaning}")
    print("Swarm-wide, in the manifest (every member must agree):")
    for f in fields(ProtocolSection):
        if f.name in SWARM_TIMING:
            print(f"  {'protocol.' + f.name:34} {f.type:6} default {f.default!r:12} {f.metadata['help']}")
    return 0


def _swarm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm", metavar="ID", help="the swarm's id: its manifest is "
                        "configs/swarms/<ID>.toml")
    parser.add_argument("--manifest", metavar="PATH", type=Path,
                        help="a manifest file instead (private swarms)")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                        default=[], help="override a manifest value (agreed values change the "
                        "digest: peers then refuse you), e.g. --set train.threads=2; or, with "
                        "join, one of this node's settings, e.g. --set node.stall_s=60 "
                        "(`lowcomm-node settings` lists them)")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="stop after this many inner steps (default: the schedule's end)")
    parser.add_argument("--grace", type=float, default=25.0,
                        help="seconds to checkpoint and leave after SIGINT/SIGTERM (default 25)")


def _version_line() -> str:
    """`lowcomm-node --version`: the release, and the versions a peer must share to exchange."""
    from node.config.manifest import SCHEMA_VERSIONS
    from p2p.version import WIRE_VERSION, release
    schemas = ", ".join(f"{name} {version}" for name, version in sorted(SCHEMA_VERSIONS.items()))
    return f"lowcomm-node {release()} (wire protocol {WIRE_VERSION}; manifest schemas: {schemas})"


def build_parser() -> argparse.ArgumentParser:
    from node.ops.cli import add_ops_commands
    from node.simulator.cli import add_simulate_command

    parser = argparse.ArgumentParser(
        prog="lowcomm-node",
        description="A peer-to-peer volunteer training node. Trains a language model locally "
                    "and exchanges with peers of its swarm (NoLoCo, DiLoCoX).",
        epilog=f"Config presets live in {CONFIG_DIR}. Every subcommand has its own --help.")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = sub.add_parser(
        "train", help="train one node alone, no network (the no-communication baseline)",
        description="Train one node alone on its data, with no network: the baseline every "
                    "swarm run is compared with. Resumes from the newest readable checkpoint in "
                    "the data directory; Ctrl-C finishes the step, checkpoints and exits.")
    _config_arguments(train)
    train.set_defaults(func=cmd_train)

    join = sub.add_parser(
        "join", help="run a node of a swarm: train locally, exchange with peers (the daemon)",
        description="Join a swarm and train: find its members on the DHT, train on this "
                    "machine, and every H inner steps exchange with peers over signed streams "
                    "(NoLoCo or DiLoCoX, as the swarm's manifest says). Resumes from the data "
                    "directory's checkpoint; a new node joining a running swarm downloads its "
                    "state first. Ctrl-C or SIGTERM checkpoints and leaves cleanly.")
    _swarm_arguments(join)
    join.add_argument("--peer", metavar="MULTIADDR", action="append", default=[],
                      help="a member to bootstrap from, e.g. /ip4/1.2.3.4/tcp/4100/p2p/12D3KooW... "
                      "(repeatable; added to the manifest's bootstrap peers)")
    join.add_argument("--listen", metavar="MULTIADDR", action="append", default=[],
                      help="where to listen (repeatable; default /ip4/0.0.0.0/tcp/0)")
    join.add_argument("--announce", metavar="MULTIADDR", action="append", default=[],
                      help="the address peers should dial instead of --listen's, e.g. a port "
                      "forwarded to this machine (repeatable)")
    join.add_argument("--data-dir", metavar="DIR", help="identity, checkpoints and logs "
                      "(default runs/<swarm id>)")
    join.add_argument("--min-peers", type=int, default=0, metavar="N",
                      help="in a swarm that has not started yet, wait (up to node.min_peers_timeout_s, "
                      "default 120 s) for N other members before training, so that the first rounds "
                      "have partners")
    join.add_argument("--port-mapping", action="store_true",
                      help="ask the router for a port mapping (UPnP/NAT-PMP); off by default")
    join.add_argument("--reachability", choices=("auto", "public", "private"), default="auto",
                      help="auto (default): a bootstrap peer dials this node back to find out; "
                      "public: others can dial it (it relays for members behind NAT); private: "
                      "behind NAT (it reserves relay slots)")
    join.add_argument("--relay", metavar="MULTIADDR", action="append", default=[],
                      help="a public member to reserve a relay slot on when behind NAT "
                      "(repeatable; default: the bootstrap peers)")
    join.add_argument("--p2pd-timeout", type=float, default=15.0, metavar="S",
                      help="seconds p2pd may take to start (default 15)")
    join.add_argument("--round-end", choices=("auto", "inline", "beside"), default="auto",
                      help="DiLoCoX: inline ends each round in the training thread; beside runs "
                      "it (message, outer step) in a thread beside training, which keeps a GPU "
                      "training while the host does the round's arithmetic (on one H100: 1.5 "
                      "steps held instead of 52) but on a CPU takes its cores; auto (default): "
                      "beside on CUDA, inline elsewhere")
    join.add_argument("--gpu", type=int, metavar="N",
                      help="train on GPU N of this machine (train.device = cuda:N): one daemon per "
                      "GPU, each with its own --data-dir and --listen port")
    from node.ops.cli import add_join_ops_arguments
    add_join_ops_arguments(join)
    join.set_defaults(func=cmd_join)

    local = sub.add_parser(
        "local-swarm", help="start N nodes of a swarm on this machine (loopback) and show them",
        description="Start N `join` daemons on loopback, each with its own data directory "
                    "under --base-dir; node 0 bootstraps the others. Shows them together until "
                    "they finish or Ctrl-C, which makes every node checkpoint and leave.")
    _swarm_arguments(local)
    local.add_argument("--nodes", type=int, default=None,
                       help="how many nodes (default 3, or one per GPU of --gpus)")
    local.add_argument("--gpus", metavar="LIST", help="give each node its own GPU, e.g. 0,1,2,3: "
                       "node i trains on the i-th (join --gpu); one GPU per node")
    local.add_argument("--base-dir", metavar="DIR", help="default runs/local-<swarm id>")
    local.set_defaults(func=cmd_local_swarm, swarm_default="local")

    init = sub.add_parser(
        "init-swarm", help="write a new swarm manifest",
        description="Write a swarm manifest (configs/swarms/<id>.toml unless --out): the model, "
                    "data, protocol and admission every member must share. Tune any value with "
                    "--set, e.g. --set protocol.inner_steps=100.")
    init.add_argument("--id", required=True, help="swarm id: lowercase letters, digits, - and _")
    init.add_argument("--description", default="", help="one line for humans")
    init.add_argument("--protocol", choices=("noloco", "dilocox"), default="noloco")
    init.add_argument("--model", default="tiny", help="model preset (configs/models/)")
    init.add_argument("--bootstrap", metavar="MULTIADDR", action="append", default=[],
                      help="a bootstrap peer (repeatable)")
    init.add_argument("--allow", metavar="PEER_ID", action="append", default=[],
                      help="admit only these peer ids (repeatable); without it the swarm is open")
    init.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[])
    init.add_argument("--data", metavar="DIR", help="pin a prepare-data directory: its "
                      "tokenizer's and shards' digests, dtype and vocabulary")
    init.add_argument("--out", metavar="PATH", help="where to write (default configs/swarms/<id>.toml)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(func=cmd_init_swarm)

    config = sub.add_parser(
        "config", help="show the effective configuration, or list every key",
        description="Print the configuration a run would use (defaults, then --config, then "
                    "--set), after validation; or list every key with its type and meaning.")
    _config_arguments(config)
    config.add_argument("--keys", action="store_true", help="list every key, type and default")
    config.set_defaults(func=cmd_config)
    settings = sub.add_parser(
        "settings", help="list this node's settings (join --set node.<name>=<value>) and the "
        "swarm-wide timing in the manifest, with units and meanings",
        description="List every wait and transport knob of a node that `lowcomm-node join --set "
                    "node.<name>=<value>` changes, and the swarm-wide bounds of exchanges that the "
                    "manifest holds, each with its unit, default and meaning.")
    settings.set_defaults(func=cmd_settings)
    add_simulate_command(sub)
    add_ops_commands(sub)
    from node.ops.model_cli import add_model_commands
    add_model_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"lowcomm-node: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, RuntimeError, OSError, P2PError) as exc:
        print(f"lowcomm-node: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
