"""One session of the bench: vLLM (started here or running) and the gateway (or the minimal
proxy) started, the workload sent to both, the setting and the report printed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from backends.config import VllmLaunch, VllmServer
from backends.launch.process import VllmProcess
from backends.models import prepare_model
from bench.lib.overhead.batches import idle_cpu
from bench.lib.overhead.cells import SUSTAINED_IN_FLIGHT, VLLM_MAX_NUM_SEQS
from bench.lib.overhead.chat import PROMPT, Target, chat_body, load_client, one_request
from bench.lib.overhead.report import first_errors, report
from bench.lib.overhead.workload import run_sustained_workload, run_workload
from bench.lib.support import (
    GATEWAY_ENV,
    GATEWAY_MODEL_ID,
    REPO,
    ServerProcess,
    affinity,
    child_env,
    gateway_ready,
    gateway_toml,
    served_model_of,
    stderr_printer,
    stop_gateway,
)
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, tiny_llama
from server.config import load_config

MINIMAL_PROXY = REPO / "bench" / "lib" / "minimal_proxy.py"

say = stderr_printer("overhead")


@dataclass
class Gateway:
    """What the session measures in the gateway's place: the gateway, or the minimal proxy."""

    url: str
    pid: int
    ready: Callable[[float], Awaitable[float]]
    """Seconds until ``/ready`` answers 200 (every backend healthy), at most the argument."""


async def start_gateway(
    args: argparse.Namespace,
    stack: contextlib.AsyncExitStack,
    config: Path,
    port: int,
    vllm_url: str,
    served: str,
    tmp: Path,
) -> Gateway:
    """The gateway (``GatewayProcess``, on this process' cores), or with ``--minimal-proxy``
    the bare aiohttp proxy in its place; started, stopped when the session ends."""
    log = tmp / "gateway.log"
    if args.minimal_proxy:
        argv = [sys.executable, str(MINIMAL_PROXY), str(port), vllm_url, served]
        url = f"http://127.0.0.1:{port}"
        proxy = ServerProcess("minimal proxy", argv, url, log, child_env(), REPO)
        proxy.start()
        stack.push_async_callback(proxy.stop)
        return Gateway(proxy.url, proxy.pid, proxy.wait_ready)
    gateway = GatewayProcess(config, port, GATEWAY_ENV, log=log)
    stack.push_async_callback(stop_gateway, gateway)
    gateway.start(wait=False)
    return Gateway(gateway.url, gateway.pid, lambda timeout_s: gateway_ready(gateway, timeout_s))


async def run(args: argparse.Namespace, vllm_cores: set[int] | None) -> bool:
    """Start vLLM (unless running) and the gateway, send the workload to both, print the
    setting and the report; True when every target is met."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (&)
        loop.add_signal_handler(sig, task.cancel)
    data_dir: Path = args.data_dir
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="semcache-overhead-")))
        model_path: Path | None = None
        vllm: VllmProcess | None = None
        if args.vllm_url:
            vllm_url = args.vllm_url.rstrip("/")
            served = args.served_model or await served_model_of(vllm_url)
            vllm_note = f"vLLM: {served} at {vllm_url} (already running)"
        else:
            if args.model_path:
                model_path = await asyncio.to_thread(prepare_model, args.model_path, data_dir, say)
                served = args.served_model or model_path.name
            else:
                model_path = await tiny_llama(data_dir)
                served = TINY_MODEL_NAME
            vllm_url = f"http://127.0.0.1:{free_port()}"

            async def start_vllm(extra_args: list[str]) -> VllmProcess:
                launch = VllmLaunch(
                    cpu_cores=args.vllm_cores if vllm_cores else None,
                    kv_cache_gib=1.0,
                    max_model_len=args.max_model_len,
                    extra_args=extra_args,
                )
                process = VllmProcess(
                    model=model_path,
                    served_model=served,
                    server=VllmServer(url=vllm_url, launch=launch),
                    data_dir=data_dir,
                    log_name=f"overhead-{served}",
                )
                say(f"starting vLLM ({served}) at {vllm_url}; log {process.log_path}")
                with affinity(vllm_cores):  # every vLLM process inherits the pinning
                    process.start()
                stack.push_async_callback(process.stop)
                waited = await process.wait_ready(600.0, say)
                say(f"vLLM ready after {waited:.0f} s")
                return process

            vllm = await start_vllm([])
            pin = f", all its processes pinned to core(s) {args.vllm_cores}" if vllm_cores else ""
            vllm_note = f"vLLM: {served} at {vllm_url} (started here{pin})"

        port = free_port()
        config_path = tmp / "gateway.toml"
        config_path.write_text(
            gateway_toml(
                data_dir=tmp,  # the gateway's disk cache is thrown away afterwards
                port=port,
                vllm_url=vllm_url,
                served=served,
                model=model_path,
                cache=args.cache,
            )
        )
        load_config(config_path)  # fail here, not in the child, on a bad config
        gateway = await start_gateway(args, stack, config_path, port, vllm_url, served, tmp)
        await gateway.ready(180.0)
        say(f"gateway ready at {gateway.url} (pid {gateway.pid})")

        clients = [load_client(args.client) for _ in range(2)]
        for client in clients:
            stack.push_async_callback(
                client.close if isinstance(client, aiohttp.ClientSession) else client.aclose
            )
        gateway_idle = await idle_cpu(gateway.pid, 3.0 if args.quick else 10.0)
        targets = (
            Target("direct", vllm_url, served, clients[0]),
            Target("gateway", gateway.url, GATEWAY_MODEL_ID, clients[1], gateway.pid, gateway_idle),
        )
        load_before = os.getloadavg()[0]
        say(f"measuring: {args.requests} requests per cell and target, {args.warmup} warm-up")
        started = time.monotonic()
        results = await run_workload(targets, args.requests, args.warmup, args.max_tokens)
        if args.sustained_rounds > 0:
            if vllm is not None:
                # vLLM again, its batch capped (a cap changes its step timing, so the cells
                # above run on vLLM's defaults); the gateway re-admits it once it answers.
                await vllm.stop()
                vllm = await start_vllm(["--max-num-seqs", str(VLLM_MAX_NUM_SEQS)])
                await gateway.ready(180.0)
                for target in targets:  # pooled connections to the old vLLM fail once
                    for _ in range(2):
                        with contextlib.suppress(Exception):
                            await one_request(target, chat_body(target.model, 0, 4, False), False)
            say(
                f"sustained load: {SUSTAINED_IN_FLIGHT} in flight, {args.sustained_rounds} "
                f"rounds of {args.sustained_seconds:g} s per cell and target"
            )
            results |= await run_sustained_workload(
                targets,
                args.sustained_rounds,
                args.sustained_seconds,
                args.max_tokens,
                vllm_url,
                control=args.control,
            )
        elapsed = time.monotonic() - started

    client_cores = sorted(os.sched_getaffinity(0))
    print()
    print(vllm_note)
    if args.minimal_proxy:
        print(f"gateway: {gateway.url}, bench/lib/minimal_proxy.py in its place (own process)")
    else:
        print(
            f"gateway: {gateway.url}, python -m server.cli serve --no-launch (uvicorn, own "
            f"process); answer cache {'on (every request a miss)' if args.cache else 'off'}"
        )
    print(
        f"gateway idle CPU (health checks, queue polling, ...): {1e3 * gateway_idle:.1f} ms/s; "
        "gw CPU below is net of it"
    )
    if vllm_cores:
        print(
            f"CPU: the gateway and this load client ({args.client}) share core(s) "
            f"{','.join(map(str, client_cores))}; vLLM has core(s) {args.vllm_cores}"
        )
    else:
        print(f"CPU: no pinning; {os.cpu_count()} cores, shared by vLLM, gateway and client")
    print(
        f"workload: chat, unique {len(PROMPT.split()) + 1}-word prompts, max_tokens="
        f"{args.max_tokens}, ignore_eos, temperature 0; {args.requests} requests per cell and "
        f"target; direct/gateway batches alternate (order flips each round); {elapsed:.0f} s"
    )
    print(
        f"machine load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
        f"(other work shares this machine)"
    )
    print()
    met = report(results, args.throughput_tolerance)
    for line in first_errors(results):
        print(f"error: {line}")
    return met
