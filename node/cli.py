"""`lowcomm-node`: the command line. Each subcommand parses, validates, then hands off."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from p2p.errors import P2PError
from node.config import CONFIG_DIR, ConfigError, describe, load_config, to_toml

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
    from node.standalone import StopFlag, run_training
    from node.train_display import TrainDisplay
    from p2p.identity import NodeIdentity, identity_path

    # The batch stream is seeded by the node's public key: two volunteers never share one.
    identity = NodeIdentity.load_or_create(identity_path(cfg.node.data_dir)).public_key_bytes
    stop = StopFlag()
    stop.install()
    with TrainDisplay(cfg.train.log_every) as display:
        run_training(cfg, identity, [display], stop)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        for key, type_name, default, help_text in describe():
            print(f"{key:26} {type_name:14} default {default!r:10}  {help_text}")
        return 0
    print(to_toml(_load(args).to_dict()), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from node.ops_cli import add_ops_commands
    from node.simulator.cli import add_simulate_command

    parser = argparse.ArgumentParser(
        prog="lowcomm-node",
        description="A peer-to-peer volunteer training node. Trains a language model locally "
                    "and exchanges with peers of its swarm (NoLoCo, DiLoCoX).",
        epilog=f"Config presets live in {CONFIG_DIR}. Every subcommand has its own --help.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = sub.add_parser(
        "train", help="train one node alone, no network (the no-communication baseline)",
        description="Train one node alone on its data, with no network: the baseline every "
                    "swarm run is compared with. Resumes from the newest readable checkpoint in "
                    "the data directory; Ctrl-C finishes the step, checkpoints and exits.")
    _config_arguments(train)
    train.set_defaults(func=cmd_train)

    config = sub.add_parser(
        "config", help="show the effective configuration, or list every key",
        description="Print the configuration a run would use (defaults, then --config, then "
                    "--set), after validation; or list every key with its type and meaning.")
    _config_arguments(config)
    config.add_argument("--keys", action="store_true", help="list every key, type and default")
    config.set_defaults(func=cmd_config)
    add_simulate_command(sub)
    add_ops_commands(sub)
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
