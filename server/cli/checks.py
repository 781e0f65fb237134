"""``semcache config check`` and ``policy check``: validate a file as the gateway would."""

from __future__ import annotations

import argparse
import os
import sys

from semcache.policy import DEFAULT_POLICY, PolicyError, load_policy
from server.cli.console import load_or_exit
from server.cli.options import env_default
from server.config import DEFAULT_CONFIG


def cmd_config_check(args: argparse.Namespace) -> int:
    config = load_or_exit(args.file)
    print(
        f"{args.file or DEFAULT_CONFIG}: OK ({len(config.models)} models, "
        f"{len(config.backends)} backends)"
    )
    return 0


def cmd_policy_check(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        print(f"semcache: invalid policy: {exc}", file=sys.stderr)
        return 2
    models = sorted(policy.model_ids)
    print(
        f"{args.file or DEFAULT_POLICY}: OK (rules for {len(models)} model(s)"
        f"{': ' if models else ''}{', '.join(models)})"
    )
    for warning in policy.warnings:
        print(f"warning: {warning}")
    return 0


def add_config_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = commands.add_parser("config", help="gateway config files").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    check = config.add_parser("check", help="validate a gateway config file")
    check.add_argument(
        "file",
        nargs="?",
        default=os.environ.get(env_default("--config").variable),
        help=f"config TOML (default: ${env_default('--config').variable}, else the shipped one)",
    )
    check.set_defaults(func=cmd_config_check)


def add_policy_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = commands.add_parser("policy", help="cache policy files").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    check = policy.add_parser("check", help="validate a policy file (as the server does)")
    check.add_argument(
        "file",
        nargs="?",
        default=os.environ.get(env_default("--policy").variable),
        help=f"policy TOML (default: ${env_default('--policy').variable}, else the shipped one)",
    )
    check.set_defaults(func=cmd_policy_check)
