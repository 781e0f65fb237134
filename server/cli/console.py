"""What the commands share at the terminal: progress lines, and a config that must load."""

from __future__ import annotations

import sys

from server.config import ConfigError, GatewayConfig, load_config


def say(message: str) -> None:
    print(f"[semcache] {message}", flush=True)


def load_or_exit(path: str | None) -> GatewayConfig:
    """The gateway config at ``path``, or exit 2 with the reason it is invalid."""
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"semcache: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
