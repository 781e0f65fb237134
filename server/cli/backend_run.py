"""``semcache backends run``: one vLLM server of a pool in the foreground, as a container runs it.

The server starts with the pool's launch settings (``backends.launch.scale.pool_launch``) on
the address given and writes to this process's output. With ``--join`` it joins the gateways'
pool once it answers ``/health``, under the address it advertises (their admin API; on a
shared pool store one gateway is enough, and adding a server already there is a harmless
409). SIGTERM or SIGINT (a pod deleted, ``podman stop``) drains it out of those gateways first
(its requests finish there), then stops vLLM; a server that exits by itself leaves them too,
and the command exits with its code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys

import httpx
import msgspec

from backends.config import ServerRole, VllmBackendConfig, VllmServer
from backends.launch.process import VllmProcess, VllmStartError
from backends.launch.scale import pool_launch, pool_of
from backends.models import prepare_model
from server.cli.console import load_or_exit, say
from server.cli.options import env_option
from server.config import GatewayConfig
from server.telemetry import vllm_traces_endpoint

JOIN_RETRY_S = 2.0
"""Between two tries to join a gateway that did not take the server yet."""
SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"


def advertised_host(host: str) -> str:
    """The address others reach a server listening on ``host`` at: ``host`` itself, or for
    a wildcard the address this machine's name resolves to (a container's or a pod's own)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    return socket.gethostbyname(socket.gethostname())


def pool_server(
    backend: VllmBackendConfig, role: ServerRole, host: str, port: int, advertised: str
) -> VllmServer:
    """The server to start: the pool's launch settings on ``host:port``; a P/D server tells
    its peers its NIXL side channel is at ``advertised`` unless the environment says where."""
    launch = pool_launch(backend, role)
    if role != "both" and not os.environ.get(SIDE_CHANNEL_HOST):
        launch = msgspec.structs.replace(launch, env={SIDE_CHANNEL_HOST: advertised, **launch.env})
    return VllmServer(url=f"http://{host}:{port}", role=role, launch=launch)


class Gateways:
    """The gateways a server joins and leaves, through their admin API."""

    def __init__(self, urls: list[str], backend: str, role: str, token: str | None) -> None:
        self.urls = urls
        self.path = f"/admin/backends/{backend}/{role}/servers"
        self.headers = {"authorization": f"Bearer {token or ''}"}

    async def join(self, url: str) -> None:
        """Add ``url`` to every gateway's pool, trying again until each one took it."""
        pending = list(self.urls)
        said: dict[str, str] = {}
        async with httpx.AsyncClient(timeout=30) as client:
            while pending:
                for gateway in list(pending):
                    problem = await self._add(client, gateway, url)
                    if problem is None:
                        pending.remove(gateway)
                    elif said.get(gateway) != problem:  # each new reason once
                        said[gateway] = problem
                        say(f"{gateway}: not joined yet ({problem}); trying again")
                if pending:
                    await asyncio.sleep(JOIN_RETRY_S)

    async def _add(self, client: httpx.AsyncClient, gateway: str, url: str) -> str | None:
        """None once ``gateway`` serves ``url``, else why not."""
        try:
            r = await client.post(gateway + self.path, json={"url": url}, headers=self.headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if r.status_code == 200:
            say(f"{gateway}: joined {self.path} as {url} ({r.json().get('state')})")
            return None
        if r.status_code == 409 and "already serves" in r.text:
            say(f"{gateway}: {url} is in the pool already")
            return None
        return f"{r.status_code}: {r.text[:200]}"

    async def leave(self, url: str, timeout_s: float) -> None:
        """Drain ``url`` out of every gateway: each waits up to ``timeout_s`` for its requests."""
        params = {"url": url, "timeout_s": str(timeout_s)}
        async with httpx.AsyncClient(timeout=timeout_s + 30) as client:
            for gateway in self.urls:
                try:
                    r = await client.delete(
                        gateway + self.path, params=params, headers=self.headers
                    )
                except httpx.HTTPError as exc:
                    say(f"{gateway}: cannot leave ({type(exc).__name__}: {exc})")
                    continue
                if r.status_code == 200:
                    drained = r.json().get("drained")
                    say(f"{gateway}: left {self.path} ({'drained' if drained else 'not drained'})")
                elif r.status_code != 404:  # 404: it was not in that gateway's pool
                    say(f"{gateway}: cannot leave ({r.status_code}: {r.text[:200]})")


async def _exited(process: VllmProcess) -> None:
    while process.returncode is None:  # noqa: ASYNC110 (a child process sets no event)
        await asyncio.sleep(0.5)


async def _first(*aws: asyncio.Future[object] | asyncio.Task[object]) -> None:
    """Wait for the first of ``aws`` to finish (the others keep running)."""
    await asyncio.wait(aws, return_when=asyncio.FIRST_COMPLETED)


async def _run(args: argparse.Namespace, config: GatewayConfig) -> int:
    vllm = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
    backend, role = pool_of(vllm, args.pool)
    if backend.model_path is None:
        raise ValueError(f"backend {backend.name!r} has no model_path to serve")
    advertised = args.advertise or advertised_host(args.host)
    server = pool_server(backend, role, args.host, args.port, advertised)
    url = f"http://{advertised}:{args.port}"
    model = await asyncio.to_thread(prepare_model, backend.model_path, config.data_path(), say)
    process = VllmProcess(
        model=model,
        served_model=backend.served_model,
        server=server,
        data_dir=config.data_path(),
        log_name=backend.name,
        kv_lease_s=backend.kv_lease_s,
        traces_endpoint=vllm_traces_endpoint(config.tracing),
        console=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gateways = Gateways(args.join, backend.name, role, args.token) if args.join else None
    stopped = asyncio.create_task(stop.wait())
    tasks: list[asyncio.Task[object]] = [stopped]
    say(f"starting vLLM {backend.name} ({role}) on {args.host}:{args.port}, reached at {url}")
    process.start()
    try:
        ready = asyncio.create_task(process.wait_ready(config.server.ready_timeout_s, say))
        tasks.append(ready)
        await _first(ready, stopped)
        if stop.is_set():
            return 0
        ready.result()
        say(f"vLLM {backend.name} ({role}) ready at {url}")
        if gateways is not None:
            tasks.append(asyncio.create_task(gateways.join(url)))
        exited = asyncio.create_task(_exited(process))
        tasks.append(exited)
        await _first(stopped, exited)
        if gateways is not None:
            await gateways.leave(url, args.drain_timeout)
        code = process.returncode
        if code is not None:
            say(f"vLLM exited with code {code}")
            return code or 1
        return 0
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        say("stopping vLLM")
        await process.stop(args.stop_grace)


def cmd_backends_run(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    args.join = [u.strip().rstrip("/") for u in (args.join or "").split(",") if u.strip()]
    try:
        return asyncio.run(_run(args, config))
    except (ValueError, VllmStartError) as exc:
        print(f"semcache: cannot run {args.pool}: {exc}", file=sys.stderr)
        return 1


def add_command(backends: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = backends.add_parser(
        "run",
        help="run one vLLM server of a pool in the foreground (a container's command), "
        "joined to gateways",
        description="Start one vLLM server with the pool's launch settings and wait. With "
        "--join it joins the gateways' pool once healthy; SIGTERM drains it out of them, then "
        "stops it.",
    )
    run.add_argument("pool", help="BACKEND/ROLE (ROLE: both, prefill, decode)")
    env_option(run, "--config")
    run.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    run.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    env_option(run, "--advertise")
    env_option(run, "--join")
    env_option(run, "--token")
    run.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="on SIGTERM, longest wait for the server's requests in each gateway (default 120 s)",
    )
    run.add_argument(
        "--stop-grace",
        type=float,
        default=20.0,
        help="then, seconds vLLM gets to stop before it is killed (default 20)",
    )
    run.set_defaults(func=cmd_backends_run)
