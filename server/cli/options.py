"""Options whose default an environment variable sets, and the environment part of --help."""

from __future__ import annotations

import argparse
import os
from typing import Any, NamedTuple


class EnvDefault(NamedTuple):
    variable: str
    option: str
    what: str


ENVIRONMENT: tuple[EnvDefault, ...] = (
    EnvDefault("SEMCACHE_CONFIG", "--config", "gateway config TOML (default: the shipped one)"),
    EnvDefault("SEMCACHE_HOST", "--host", "address the gateway listens on"),
    EnvDefault("SEMCACHE_PORT", "--port", "port the gateway listens on"),
    EnvDefault("SEMCACHE_POLICY", "--policy", "cache policy TOML (default: the shipped one)"),
    EnvDefault("SEMCACHE_URL", "--url", "a running gateway (default: http://127.0.0.1:8080)"),
    EnvDefault("SEMCACHE_ADMIN_TOKEN", "--token", "bearer token of the admin API"),
    EnvDefault(
        "SEMCACHE_JOIN", "--join", "gateways a `backends run` server joins (comma-separated)"
    ),
    EnvDefault(
        "SEMCACHE_ADVERTISE", "--advertise", "address gateways reach a `backends run` server at"
    ),
)
"""Every option whose default an environment variable sets: declared here only."""

OTHER_ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("SEMCACHE_CACHE_SALT_SECRET", "vLLM cache_salt key (a backend's cache_salt_secret_env)"),
    ("SEMCACHE_ENCODER_RUNTIME", "the cache encoder's runtime: auto, onnx or torch"),
    ("SEMCACHE_VLLM_DEVICE", "device of launched vLLM servers: cpu or cuda"),
)
"""Variables read below the command line (config, encoder, launcher), listed in --help."""


def environment_help() -> str:
    rows = [f"  {e.variable:<28}{e.option:<13}{e.what}" for e in ENVIRONMENT]
    rows += [f"  {name:<41}{what}" for name, what in OTHER_ENVIRONMENT]
    return "environment (variable, option it sets the default of):\n" + "\n".join(rows)


def env_default(option: str) -> EnvDefault:
    (env,) = [e for e in ENVIRONMENT if e.option == option]
    return env


def env_option(parser: argparse.ArgumentParser, option: str, **kwargs: Any) -> None:
    """Add ``option`` with its default from its variable in :data:`ENVIRONMENT`."""
    env = env_default(option)
    default = os.environ.get(env.variable, kwargs.pop("default", None))
    help_text = kwargs.pop("help", env.what)
    parser.add_argument(option, default=default, help=f"{help_text} (${env.variable})", **kwargs)
