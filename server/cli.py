"""The `semcache` command line: serve the gateway, start backends, check config files."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import httpx
import uvicorn

from backends.config import VllmBackend
from backends.launch import Launcher, VllmStartError
from semcache.policy import PolicyError, load_policy
from server.app import create_app, registry_from_config
from server.config import ConfigError, GatewayConfig, load_config
from server.uvicorn_config import uvicorn_config


def say(message: str) -> None:
    print(f"[semcache] {message}", flush=True)


def _load(path: str | None) -> GatewayConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"semcache: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _launcher(config: GatewayConfig) -> Launcher:
    vllm = [b for b in config.backends if isinstance(b, VllmBackend)]
    return Launcher(
        vllm, config.data_path(), progress=say, ready_timeout_s=config.server.ready_timeout_s
    )


async def _serve(config: GatewayConfig, launch: bool) -> None:
    host, port = config.server.host, config.server.port
    launcher = _launcher(config) if launch else None
    async with launcher if launcher is not None else contextlib.nullcontext():
        say("loading models and computing revisions")
        registry = await asyncio.to_thread(registry_from_config, config)
        app = create_app(config, registry)
        server = uvicorn.Server(uvicorn_config(app, host, port))
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn has no event)
            await asyncio.sleep(0.05)
        if server.started:
            settle_gc()
            say(f"ready: OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops everything)")
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
    which would otherwise walk all of it (~50 ms with just the chat model configured, more
    with embedding models: a pause for every request in flight), walks only what came
    after. Young collections run less often (``GC_THRESHOLD0``); cycles still go.
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
    config = _load(args.config)
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


async def _backends_up(config: GatewayConfig) -> None:
    async with _launcher(config):
        say("backends are up (Ctrl-C stops them)")
        await asyncio.Event().wait()


def cmd_backends_up(args: argparse.Namespace) -> int:
    config = _load(args.config)
    try:
        asyncio.run(_backends_up(config))
    except VllmStartError as exc:
        print(f"semcache: a backend failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("backends stopped")
    return 0


def cmd_policy_check(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        print(f"semcache: invalid policy: {exc}", file=sys.stderr)
        return 2
    models = sorted(policy.model_ids)
    print(
        f"{args.file}: OK (rules for {len(models)} model(s){': ' if models else ''}"
        f"{', '.join(models)})"
    )
    return 0


def cmd_cache_purge(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("SEMCACHE_ADMIN_TOKEN", "")
    body = {"kind": args.kind, "target": args.target or ""}
    try:
        r = httpx.post(
            f"{args.url.rstrip('/')}/admin/cache/purge",
            json=body,
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )
    except httpx.HTTPError as exc:
        print(f"semcache: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(r.text)
    return 0 if r.status_code == 200 else 1


def cmd_config_check(args: argparse.Namespace) -> int:
    config = _load(args.file)
    print(f"{args.file}: OK ({len(config.models)} models, {len(config.backends)} backends)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="semcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the backends the config launches, then the gateway")
    serve.add_argument("--config", default=os.environ.get("SEMCACHE_CONFIG"), help="config TOML")
    serve.add_argument("--host", default=os.environ.get("SEMCACHE_HOST"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("SEMCACHE_PORT", "0")))
    serve.add_argument("--policy", default=os.environ.get("SEMCACHE_POLICY"), help="policy TOML")
    serve.add_argument("--no-launch", action="store_true", help="use running backends only")
    serve.set_defaults(func=cmd_serve)

    backends = sub.add_parser("backends", help="manage vLLM backends").add_subparsers(
        dest="action", required=True
    )
    up = backends.add_parser("up", help="start the vLLM servers the config names and wait")
    up.add_argument("--config", default=os.environ.get("SEMCACHE_CONFIG"))
    up.set_defaults(func=cmd_backends_up)

    config = sub.add_parser("config", help="configuration files").add_subparsers(
        dest="action", required=True
    )
    check = config.add_parser("check", help="validate a gateway config file")
    check.add_argument("file")
    check.set_defaults(func=cmd_config_check)

    policy = sub.add_parser("policy", help="cache policy files").add_subparsers(
        dest="action", required=True
    )
    pcheck = policy.add_parser("check", help="validate a policy file (as the server does)")
    pcheck.add_argument("file")
    pcheck.set_defaults(func=cmd_policy_check)

    cache = sub.add_parser("cache", help="the cache of a running gateway").add_subparsers(
        dest="action", required=True
    )
    purge = cache.add_parser("purge", help="purge entries through the admin API")
    purge.add_argument("kind", choices=["key", "model", "tenant", "scope", "tag", "all"])
    purge.add_argument("target", nargs="?", default="")
    purge.add_argument("--url", default=os.environ.get("SEMCACHE_URL", "http://127.0.0.1:8080"))
    purge.add_argument("--token", help="admin token (default: $SEMCACHE_ADMIN_TOKEN)")
    purge.set_defaults(func=cmd_cache_purge)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
