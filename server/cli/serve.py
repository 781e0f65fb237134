"""``semcache serve``: launch the config's backends, then run the gateway until stopped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
from collections.abc import Coroutine
from typing import Any

from backends.launch.process import VllmStartError
from semcache.policy import PolicyError, load_policy
from server.app import create_app, registry_from_config
from server.cli.backends import launcher
from server.cli.console import load_or_exit, say
from server.cli.options import env_option
from server.config import GatewayConfig
from server.http.draining import DrainingServer
from server.http.uvicorn_config import uvicorn_config
from server.identity.auth import describe, exposure_problem


async def _serve(config: GatewayConfig, launch: bool) -> None:
    host, port = config.server.host, config.server.port
    backends = launcher(config) if launch else None
    async with backends if backends is not None else contextlib.nullcontext():
        say("loading models and computing revisions")
        registry = await asyncio.to_thread(registry_from_config, config)
        app = create_app(config, registry)
        server = DrainingServer(
            uvicorn_config(app, host, port), app.state.drain, config.server.drain_timeout_s
        )
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn has no event)
            await asyncio.sleep(0.05)
        if server.started:
            settle_gc()
            say(f"ready: OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops everything)")
            say(f"authentication: {describe(config.auth)}")
        await task
        say("stopping")


GC_THRESHOLD0 = 10_000
"""Container objects allocated, net, between two young collections (CPython's default: 700).
A request leaves a few hundred objects in reference cycles (tasks, futures, exceptions), so
the default collects every few requests; each collection walks the requests in flight."""


def settle_gc() -> None:
    """Tune the cyclic garbage collector once the gateway has started.

    Everything allocated while starting (modules, models, the app) lives as long as the
    process: ``gc.freeze`` takes it out of the collector's sight, so a full collection,
    which would otherwise walk all of it (a pause for every request in flight), walks only
    what came after. Young collections run less often (``GC_THRESHOLD0``); cycles still go.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, gen1, gen2)


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where installed (uvicorn[standard] brings it): less CPU per request."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def cmd_serve(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    if args.policy:
        config.policy = args.policy
    try:
        load_policy(config.policy)  # refuse to start (and to launch vLLM) on an invalid policy
    except PolicyError as exc:
        print(f"semcache: invalid policy, not starting: {exc}", file=sys.stderr)
        return 2
    if args.host:
        config.server.host = args.host
    if args.port:
        config.server.port = args.port
    problem = exposure_problem(config.auth, config.server.host)
    if problem is not None:
        print(f"semcache: not starting: {problem}", file=sys.stderr)
        return 2
    try:
        run_loop(_serve(config, launch=not args.no_launch))
    except VllmStartError as exc:
        print(f"semcache: a backend failed to start: {exc}", file=sys.stderr)
        return 1
    except PolicyError as exc:
        print(f"semcache: invalid policy, not starting: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted; backends stopped")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve", help="start the backends the config launches, then the gateway"
    )
    env_option(serve, "--config")
    env_option(serve, "--host")
    env_option(serve, "--port", type=int)
    env_option(serve, "--policy")
    serve.add_argument("--no-launch", action="store_true", help="use running backends only")
    serve.set_defaults(func=cmd_serve)
