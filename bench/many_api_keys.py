"""Exact-cache hits with 1,000 API keys in the store vs one (issue 33): no slower.

Two gateways, each a ``python -m server.cli serve --no-launch`` process pinned to core 0
with taskset, running side by side with the same config (a config token of tenant
``bench``, an admin token, keys on in their default local store). ``small`` holds one API
key, ``large`` 1,000, all created through the admin API (``POST /admin/keys``) before
measuring. The targets, each a gateway and the token ``wrk`` sends:

- ``config``: ``small``, the config token (the baseline: no API key involved);
- ``key-of-1``: ``small``, its one key's secret;
- ``key-of-1000``: ``large``, the secret of the last key made;
- ``config-1000``: ``large``, the config token (the store's size alone).

The claim is ``key-of-1000`` against ``key-of-1`` (the store's size, on the API-key path);
``key-of-1`` against ``config`` is what authenticating by an API key costs at all.

The backend is a local HTTP server in this process answering like vLLM: only each target's
first request reaches it, every measured request is an exact hit (the early-hit path). This
process and ``wrk`` (one thread, a fixed Lua request) share core 1. Each round runs one wrk
run per target, the order reversed every other round, so drift on this shared machine
touches every target. Printed: the median over the rounds of req/s, p50 and p99 for each
target, the ratio of each to its baseline (the median of the per-round ratios, with a
bootstrap 95 % interval over the rounds), and wrk's CPU share of its core: well under 100 %
says the gateway, not wrk, sets the figure. Every run must see no non-2xx answer nor socket
error.

    .venv/bin/python bench/many_api_keys.py                       # 5 s runs, 6 rounds
    .venv/bin/python bench/many_api_keys.py --seconds 3 --rounds 4 --keys 1000 --connections 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.chat_hit import HIT_BODY, SERVED, fake_vllm
from bench.lib.support import (
    GATEWAY_ENV,
    bootstrap_interval,
    exit_status,
    gateway_ready,
    gateway_toml,
    stderr_printer,
    stop_gateway,
    toml_value,
)
from bench.lib.wrk import WrkRun, run_wrk, wrk_version
from harness.gateway import GatewayProcess
from harness.ports import free_port

say = stderr_printer("many_api_keys")
TOKEN = "bench-config-token"
ADMIN = "bench-admin-token"
TARGETS = ("config", "key-of-1", "key-of-1000", "config-1000")
"""Each measured target: (the gateway it runs on, the token wrk sends) in ``cells``."""
BASELINE = {"config": "config", "key-of-1": "config", "key-of-1000": "key-of-1"}
BASELINE |= {"config-1000": "config"}
"""What each target's ratio is against."""


def config_text(data_dir: Path, port: int, upstream: str) -> str:
    tokens = [
        "[[auth.tokens]]",
        f"token = {toml_value(TOKEN)}",
        'tenant = "bench"',
        'name = "bench"',
        "[[auth.tokens]]",
        f"token = {toml_value(ADMIN)}",
        'tenant = "ops"',
        'name = "ops"',
        'roles = ["admin"]',
    ]
    return gateway_toml(
        data_dir=data_dir,
        port=port,
        vllm_url=upstream,
        served=SERVED,
        model=None,
        extra="\n".join(tokens) + "\n",
    )


def gateway(config: Path, port: int, log: Path) -> GatewayProcess:
    """The gateway of this checkout on core 0 (not yet started)."""
    return GatewayProcess(config, port, GATEWAY_ENV, cores="0", log=log)


async def create_keys(url: str, count: int) -> str:
    """``count`` keys of tenant ``bench`` through the admin API; the last one's secret."""
    secret = ""
    async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        for i in range(count):
            r = await c.post(url + "/admin/keys", json={"tenant": "bench", "name": f"k{i}"})
            r.raise_for_status()
            secret = r.json()["secret"]
        listed = (await c.get(url + "/admin/keys")).json()["data"]
    if len(listed) != count:
        raise RuntimeError(f"{url}: {len(listed)} keys listed, {count} made")
    return secret


async def prime(url: str, token: str) -> None:
    """The hit request, sent until the cache answers it (and checked to be a hit)."""
    headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(3):
            r = await client.post(url + "/v1/chat/completions", content=HIT_BODY, headers=headers)
            r.raise_for_status()
        if r.headers.get("cf-aig-cache-status") != "HIT":
            raise RuntimeError(f"{url}: the repeated request is not a hit: {dict(r.headers)}")


def wrk_script(token: str, path: Path) -> Path:
    lines = [
        'wrk.method = "POST"',
        'wrk.headers["Content-Type"] = "application/json"',
        f'wrk.headers["Authorization"] = "Bearer {token}"',
        f"wrk.body = [==[{HIT_BODY.decode()}]==]",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def chat_wrk(url: str, script: Path, connections: int, seconds: int) -> WrkRun:
    """wrk on core 1 against the gateway's chat route."""
    chat = url + "/v1/chat/completions"
    return run_wrk(chat, script, connections=connections, seconds=seconds, core="1")


def ratio_interval(ratios: list[float]) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median of per-round ratios."""
    values = np.array(ratios)
    return bootstrap_interval(
        lambda rng: float(np.median(values[rng.integers(0, len(values), len(values))]))
    )


async def run(args: argparse.Namespace) -> bool:
    os.sched_setaffinity(0, {1})  # this process (the fake backend) beside wrk
    upstream = fake_vllm()
    servers: dict[str, GatewayProcess] = {}
    runs: dict[str, list[WrkRun]] = {t: [] for t in TARGETS}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp:
            folder = Path(tmp)
            for name in ("small", "large"):
                port = free_port()
                config = folder / f"{name}.toml"
                config.write_text(config_text(folder / name, port, upstream.url))
                servers[name] = gateway(config, port, folder / f"{name}.log")
            for server in servers.values():
                server.start(wait=False)
            for server in servers.values():
                await gateway_ready(server, 240)
            one = await create_keys(servers["small"].url, 1)
            started = time.monotonic()
            secret = await create_keys(servers["large"].url, args.keys)
            say(
                f"{args.keys} keys made through the admin API in {time.monotonic() - started:.1f} s"
            )
            cells = {
                "config": (servers["small"], TOKEN),
                "key-of-1": (servers["small"], one),
                "key-of-1000": (servers["large"], secret),
                "config-1000": (servers["large"], TOKEN),
            }
            scripts = {}
            for name, (server, token) in cells.items():
                await prime(server.url, token)
                scripts[name] = wrk_script(token, folder / f"{name}.lua")
            for name, (server, _) in cells.items():  # warm-up, not measured
                await asyncio.to_thread(chat_wrk, server.url, scripts[name], args.connections, 1)
            for n in range(args.rounds):
                order = list(TARGETS) if n % 2 == 0 else list(TARGETS)[::-1]
                for name in order:
                    server = cells[name][0]
                    done = await asyncio.to_thread(
                        chat_wrk, server.url, scripts[name], args.connections, args.seconds
                    )
                    if done.report.non_2xx or done.report.socket_errors:
                        raise RuntimeError(f"{name}: errors: {done.report}")
                    runs[name].append(done)
                    say(
                        f"round {n + 1} {name:11} {done.report.rps:8.0f} req/s "
                        f"p50 {done.report.p50_ms:.2f} ms p99 {done.report.p99_ms:.2f} ms "
                        f"wrk {done.wrk_cpu:.0%}"
                    )
    finally:
        for server in servers.values():
            await stop_gateway(server)
        upstream.stop()
    load = os.getloadavg()[0]
    print(
        f"\n{wrk_version()}, -t1 -c{args.connections} -d{args.seconds}s, {args.rounds} rounds; "
        f"gateways on core 0, wrk on core 1; {args.keys} API keys; load {load:.1f}"
    )
    print(
        f"{'target':11} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'wrk cpu':>8} "
        f"{'vs':>9} {'req/s ratio [95 % CI]':>24} {'p50 ratio':>9}"
    )
    for name in TARGETS:
        mine, base = runs[name], runs[BASELINE[name]]
        rps = statistics.median(r.report.rps for r in mine)
        p50 = statistics.median(r.report.p50_ms for r in mine)
        p99 = statistics.median(r.report.p99_ms for r in mine)
        cpu = statistics.median(r.wrk_cpu for r in mine)
        ratios = [m.report.rps / b.report.rps for m, b in zip(mine, base, strict=True)]
        p50s = [m.report.p50_ms / b.report.p50_ms for m, b in zip(mine, base, strict=True)]
        low, high = ratio_interval(ratios)
        cell = f"{statistics.median(ratios):.3f} [{low:.3f}, {high:.3f}]"
        print(
            f"{name:11} {rps:8.0f} {p50:7.2f} {p99:7.2f} {cpu:8.0%} {BASELINE[name]:>9} "
            f"{cell:>24} {statistics.median(p50s):9.3f}"
        )
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--keys", type=int, default=1000, help="API keys in the `large` store")
    return exit_status(run(parser.parse_args(argv)), say)


if __name__ == "__main__":
    raise SystemExit(main())
