"""``semcache backends up`` and ``backends scale``: the config's vLLM servers, one pool's size
(``backends run``, one server in the foreground: ``server.cli.backend_run``)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import httpx

from backends.config import VllmBackendConfig
from backends.launch.launcher import Launcher
from backends.launch.process import VllmStartError
from backends.launch.scale import ScaleRecords, pool_of, start_server, stop_server
from server.cli.backend_run import add_command as add_run_command
from server.cli.console import load_or_exit, say
from server.cli.gateway_auth import NoToken, bearer, refusal, say_no_token
from server.cli.options import env_option
from server.config import GatewayConfig
from server.telemetry import vllm_traces_endpoint


def launcher(config: GatewayConfig) -> Launcher:
    """The launcher of the vLLM servers ``config`` starts, reporting progress on stdout."""
    vllm = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
    return Launcher(
        vllm,
        config.data_path(),
        progress=say,
        ready_timeout_s=config.server.ready_timeout_s,
        traces_endpoint=vllm_traces_endpoint(config.tracing),
    )


async def _backends_up(config: GatewayConfig) -> None:
    async with launcher(config):
        say("backends are up (Ctrl-C stops them)")
        await asyncio.Event().wait()


def cmd_backends_up(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    try:
        asyncio.run(_backends_up(config))
    except VllmStartError as exc:
        print(f"semcache: a backend failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("backends stopped")
    return 0


def _gateways(args: argparse.Namespace) -> list[str]:
    return [u.strip().rstrip("/") for u in args.url.split(",") if u.strip()]


def _admin(args: argparse.Namespace) -> dict[str, str]:
    return bearer(args, "backends scale")


async def _scale_up(args: argparse.Namespace, config: GatewayConfig) -> int:
    """Start one more server of the pool, then add it to every gateway named."""
    vllm = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
    backend, role = pool_of(vllm, args.pool)
    server, record = await start_server(
        backend,
        role,
        config.data_path(),
        ready_timeout_s=config.server.ready_timeout_s,
        progress=say,
        traces_endpoint=vllm_traces_endpoint(config.tracing),
    )
    path = f"/admin/backends/{backend.name}/{role}/servers"
    async with httpx.AsyncClient(timeout=60) as client:
        for gateway in _gateways(args):
            try:
                r = await client.post(
                    gateway + path, json={"url": server.url}, headers=_admin(args)
                )
            except httpx.HTTPError as exc:
                r = None
                problem = str(exc)
            if r is not None and r.status_code == 409 and "already serves" in r.text:
                # gateways sharing a pool store: an earlier gateway's add reached it first
                say(f"{gateway}: {backend.name}/{role} has {server.url} already")
                continue
            if r is None or r.status_code != 200:
                problem = refusal(r, gateway) if r is not None else f"{gateway}: {problem}"
                print(f"semcache: cannot add {server.url}: {problem}", file=sys.stderr)
                await _scale_down_one(args, backend.name, role, config, record.url, stop=True)
                return 1
            say(f"{gateway}: {backend.name}/{role} + {server.url} ({r.json()['state']})")
    say(f"{server.url} serves (log {record.log}); `scale {args.pool} -1` stops it")
    return 0


async def _scale_down_one(
    args: argparse.Namespace,
    backend: str,
    role: str,
    config: GatewayConfig,
    url: str,
    *,
    stop: bool,
) -> bool:
    """Drain ``url`` out of every gateway (waiting for its requests), then stop it."""
    path = f"/admin/backends/{backend}/{role}/servers"
    drained = True
    async with httpx.AsyncClient(timeout=args.drain_timeout + 30) as client:
        for gateway in _gateways(args):
            params = {"url": url, "timeout_s": str(args.drain_timeout)}
            try:
                r = await client.delete(gateway + path, params=params, headers=_admin(args))
            except httpx.HTTPError as exc:
                print(f"semcache: cannot reach {gateway}: {exc}", file=sys.stderr)
                drained = False
                continue
            if r.status_code == 404:
                continue  # this gateway does not send it anything
            if r.status_code != 200 or not r.json()["drained"]:
                print(f"semcache: {gateway} did not drain {url}: {r.text}", file=sys.stderr)
                drained = False
            else:
                say(f"{gateway}: {backend}/{role} - {url} (drained)")
    if not drained and not stop:
        return False
    records = ScaleRecords(config.data_path(), backend, role)
    for record in records.read():
        if record.url == url:
            await stop_server(record)
            records.remove(url)
            say(f"stopped vLLM at {url}")
    return drained


async def _scale_down(args: argparse.Namespace, config: GatewayConfig) -> int:
    vllm = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
    backend, role = pool_of(vllm, args.pool)
    started = ScaleRecords(config.data_path(), backend.name, role).read()
    if not started:
        print(
            f"semcache: no server of {backend.name}/{role} was started by `scale +1` "
            "(servers of the config stop with `serve` / `backends up`)",
            file=sys.stderr,
        )
        return 1
    url = started[-1].url
    if not await _scale_down_one(args, backend.name, role, config, url, stop=False):
        print(f"semcache: {url} still runs requests; it keeps running", file=sys.stderr)
        return 1
    return 0


def cmd_backends_scale(args: argparse.Namespace) -> int:
    try:
        _admin(args)  # before a server starts
    except NoToken as exc:
        return say_no_token(exc)
    config = load_or_exit(args.config)
    scale = _scale_up if args.delta == "+1" else _scale_down
    try:
        return asyncio.run(scale(args, config))
    except (ValueError, VllmStartError) as exc:
        print(f"semcache: cannot scale {args.pool}: {exc}", file=sys.stderr)
        return 1


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backends = commands.add_parser("backends", help="manage vLLM backends").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    up = backends.add_parser("up", help="start the vLLM servers the config names and wait")
    env_option(up, "--config")
    up.set_defaults(func=cmd_backends_up)
    scale = backends.add_parser(
        "scale",
        help="start one more vLLM server of a pool and add it to running gateways, or drain "
        "and stop the last one started so",
        description="+1: start a vLLM server with the pool's launch settings on a free port "
        "and add it to each gateway (admin API); -1: drain the last server +1 started out of "
        "each gateway (its requests finish), then stop it.",
    )
    scale.add_argument("pool", help="BACKEND/ROLE (ROLE: both, prefill, decode)")
    scale.add_argument("delta", choices=["+1", "-1"])
    env_option(scale, "--config")
    env_option(
        scale,
        "--url",
        default="http://127.0.0.1:8080",
        help="the gateways, comma-separated",
    )
    env_option(scale, "--token", help="an admin token")
    scale.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        help="-1: longest wait for the requests of the server (seconds, default 600)",
    )
    scale.set_defaults(func=cmd_backends_scale)
    add_run_command(backends)
