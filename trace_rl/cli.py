"""The `trace-rl` command line.

Commands import heavy modules (torch, vllm, prefect) only when they run, so
`trace-rl train CONFIG --dry-run` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from trace_rl.config import Config, ConfigError, config_to_toml, load_config


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set trainer.lr=1e-5 --set env.0.group_size=4",
    )


def _load(args) -> Config:
    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    config = _load(args)
    if args.dry_run:
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(config_to_toml(config), "toml", theme="ansi_dark", background_color="default"))
        return 0
    from flows.train import run_training

    run_training(config, resume=args.resume, overwrite=args.overwrite)
    return 0


def cmd_config_schema(args) -> int:
    print(json.dumps(Config.model_json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trace-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training run (or --dry-run to print the resolved config)")
    _add_config_args(train)
    train.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue an existing run from its latest checkpoint")
    mode.add_argument("--overwrite", action="store_true", help="wipe an existing run directory first")
    train.set_defaults(func=cmd_train)

    schema = sub.add_parser("config-schema", help="print the JSON schema of the config")
    schema.set_defaults(func=cmd_config_schema)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
