"""The `semcache` command line: every user command, in one parser.

Serve the gateway, start its backends, check config and policy files, purge a running
gateway's cache, print its usage ledger, manage its API keys, calibrate the semantic
matcher, retrain the shipped verifier and classifier head, prepare a config's models.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from server.cli import (
    backends,
    cache,
    calibrate,
    checks,
    keys,
    prepare,
    serve,
    training,
    usage,
)
from server.cli.options import environment_help


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (this module's docstring is its description), commands in order."""
    parser = argparse.ArgumentParser(
        prog="semcache",
        description=__doc__,
        epilog=environment_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_commands(commands)
    backends.add_commands(commands)
    checks.add_config_commands(commands)
    checks.add_policy_commands(commands)
    cache.add_commands(commands)
    usage.add_commands(commands)
    keys.add_commands(commands)
    calibrate.add_commands(commands)
    training.add_commands(commands)
    prepare.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code
