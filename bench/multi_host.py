"""The multi-host cluster (``harness/cluster/``): exact-cache hits/s through the load
balancer with one and with two gateways, and prefill/decode TTFT with the KV crossing the
veth (UCX over TCP) against the KV moved through shared memory.

Hits: the cluster's gateways are pinned, gw1 to core 0 and gw2 to core 1; HAProxy and
``wrk`` (one thread, ``--connections`` connections, a Lua script POSTing one chat request
that both gateways hold in their memory tier) are not pinned: with two cores, pinning the
generator would put it on a gateway's core anyway. One gateway = gw2 put in maintenance on
HAProxy's runtime API (``disable server``), two = enabled again. The two targets alternate,
the order flipping each round; every answer must be a 2xx and the run's gateways must have
answered as many hits as wrk counted requests.

P/D: each request is a new ~600-token prompt sent to gw1 with ``stream: true`` and
``max_tokens: 2``: TTFT is the time to the first content chunk, which covers the prefill on
p1, the KV hand-off and decode's first token on d1. Decode's ``external_prefix_cache_hits``
must rise by the prompt length each time (the KV really moved), and NIXL's own transfer time
(``vllm:nixl_xfer_time_seconds``) is read beside it. The prefill and decode servers are
restarted to switch transports (UCX ``tcp`` on ``eth0`` only, or UCX's own choice, shared
memory, between hosts that share a kernel), so the two transports run one after the other,
tcp first, not interleaved.

    .venv/bin/python bench/multi_host.py [--seconds 5] [--rounds 2] [--connections 16]
                                         [--pd-requests 12] [--skip-hits] [--skip-pd]

Needs what the cluster needs (root, ``ip netns``, haproxy, redis-server) and ``wrk``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.support import exit_status, pct, stderr_printer
from bench.lib.wrk import WrkReport, run_wrk
from harness.cluster import (
    GATEWAYS,
    MODEL_ID,
    TOKEN,
    Cluster,
    KvTransport,
    missing_requirements,
)
from harness.metrics import parse_metric

say = stderr_printer("multi_host")
SENTENCE = "The cat reads a book near the window. "
HIT_BODY = {
    "model": MODEL_ID,
    "messages": [{"role": "user", "content": "How far is the edge from the model?"}],
    "max_tokens": 8,
    "temperature": 0,
}
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {token}"
"""


def wrk(url: str, seconds: int, connections: int, script: Path) -> WrkReport:
    return run_wrk(url, script, connections=connections, seconds=seconds, timeout=None).report


async def hits_served(client: httpx.AsyncClient, cluster: Cluster) -> float:
    total = 0.0
    for gw in GATEWAYS:
        try:
            page = (await client.get(f"{cluster.gateway_url(gw)}/metrics")).text
        except httpx.HTTPError:
            continue
        total += parse_metric(page, "semcache_exact_hits_total")
    return total


async def bench_hits(
    cluster: Cluster, seconds: int, rounds: int, connections: int, tmp: Path
) -> dict[str, list[WrkReport]]:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    script = tmp / "hit.lua"
    script.write_text(
        WRK_SCRIPT.replace("{body}", orjson.dumps(HIT_BODY).decode()).replace("{token}", TOKEN)
    )
    runs: dict[str, list[WrkReport]] = {"1 gateway": [], "2 gateways": []}
    url = f"{cluster.lb_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        for gw in GATEWAYS:  # stored once, then in both gateways' memory tier
            r = await client.post(
                f"{cluster.gateway_url(gw)}/v1/chat/completions", json=HIT_BODY, headers=auth
            )
            r.raise_for_status()
        for r_i in range(rounds):
            order = list(runs) if r_i % 2 == 0 else list(runs)[::-1]
            for name in order:
                action = "disable" if name == "1 gateway" else "enable"
                cluster.lb_command(f"{action} server gateways/gw2")
                await asyncio.sleep(0.5)
                before = await hits_served(client, cluster)
                run = await asyncio.to_thread(wrk, url, seconds, connections, script)
                await asyncio.sleep(1.0)  # requests wrk left in flight still finish
                served = await hits_served(client, cluster) - before
                if served < run.requests:
                    say(f"{name}: {served:.0f} hits for {run.requests} requests")
                runs[name].append(run)
                say(
                    f"round {r_i + 1} {name}: {run.rps:,.0f} req/s, p50 {run.p50_ms:.2f} ms, "
                    f"p99 {run.p99_ms:.2f} ms, non-2xx {run.non_2xx}"
                )
        cluster.lb_command("enable server gateways/gw2")
    return runs


def kv_read_transports(cluster: Cluster) -> list[str]:
    """The UCX transports decode's KV reads (``ucp_get``) used, from its protocol log."""
    found: set[str] = set()
    for block in cluster.current_log("d1").split("remote memory read by ucp_get")[1:]:
        found.update(re.findall(r"\|\s*(?:\d+x )?([a-z0-9_]+/[A-Za-z0-9_.:-]+)", block[:800]))
    return sorted(found)


@dataclass
class PdRun:
    transports: list[str]
    ttft_s: list[float]
    xfer_s: float
    """NIXL's mean transfer time over the run."""
    kv_bytes: float
    handed_off: int


async def restart_pd(cluster: Cluster, transport: KvTransport) -> None:
    """Restart p1 and d1 on ``transport`` (nothing to do when they already run on it)."""
    if cluster.kv_transport == transport and cluster.running("p1") and cluster.running("d1"):
        return
    cluster.kv_transport = transport
    for host in ("p1", "d1"):
        await asyncio.to_thread(cluster.stop, host)
    for host in ("p1", "d1"):
        await asyncio.to_thread(cluster.start, host, wait=False)
    for host in ("p1", "d1"):
        await asyncio.to_thread(cluster.wait_ready, host)
    ready = f"{cluster.gateway_url('gw1')}/ready"
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(120):
            if (await client.get(ready)).status_code == 200:
                return
            await asyncio.sleep(0.5)
    raise RuntimeError("gw1 is not ready after the restart")


async def ttft(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[float, int]:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    first: float | None = None
    prompt_tokens = 0
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = orjson.loads(line[5:])
            if first is None and any(
                (c.get("delta") or {}).get("content") for c in event.get("choices") or []
            ):
                first = time.perf_counter() - began
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
    assert first is not None, "no content chunk"
    return first, prompt_tokens


async def decode_counters(client: httpx.AsyncClient, cluster: Cluster) -> tuple[float, ...]:
    page = (await client.get(f"{cluster.vllm_url('d1')}/metrics")).text
    return (
        parse_metric(page, "vllm:external_prefix_cache_hits_total"),
        parse_metric(page, "vllm:nixl_xfer_time_seconds_sum"),
        parse_metric(page, "vllm:nixl_xfer_time_seconds_count"),
        parse_metric(page, "vllm:nixl_bytes_transferred_sum"),
    )


async def bench_pd(cluster: Cluster, transport: KvTransport, requests: int) -> PdRun:
    await restart_pd(cluster, transport)
    url = cluster.gateway_url("gw1")
    run = PdRun([], [], 0.0, 0.0, 0)
    async with httpx.AsyncClient(timeout=120) as client:
        await ttft(client, url, f"Warm {uuid.uuid4().hex}. " + SENTENCE * 60)  # the handshake
        await asyncio.sleep(1.0)
        start = await decode_counters(client, cluster)
        for _ in range(requests):
            hits = (await decode_counters(client, cluster))[0]
            seconds, prompt_tokens = await ttft(
                client, url, f"Story {uuid.uuid4().hex}. " + SENTENCE * 60
            )
            await asyncio.sleep(0.3)  # vLLM updates its counters just after answering
            moved = (await decode_counters(client, cluster))[0] - hits
            if moved >= prompt_tokens > 0:
                run.handed_off += 1
            run.ttft_s.append(seconds)
        end = await decode_counters(client, cluster)
    run.transports = kv_read_transports(cluster)
    transfers = end[2] - start[2]
    run.xfer_s = (end[1] - start[1]) / transfers if transfers else float("nan")
    run.kv_bytes = (end[3] - start[3]) / transfers if transfers else float("nan")
    say(
        f"P/D over {transport}: TTFT p50 {pct(run.ttft_s, 50) * 1000:.1f} ms, "
        f"NIXL transfer {run.xfer_s * 1000:.2f} ms for {run.kv_bytes / 1e6:.2f} MB, "
        f"{run.handed_off}/{requests} handed off, UCX reads via {', '.join(run.transports)}"
    )
    return run


async def main(args: argparse.Namespace) -> bool:
    missing = missing_requirements()
    if shutil.which("wrk") is None:
        missing.append("wrk (bash scripts/wrk.sh install)")
    if missing:
        say("cannot run, missing: " + ", ".join(missing))
        return False
    cluster = Cluster(gateway_cores={"gw1": "0", "gw2": "1"})
    cluster.down()  # the gateways' pinning is set when they start
    began = time.monotonic()
    await asyncio.to_thread(cluster.up)
    say(f"cluster up in {time.monotonic() - began:.0f} s")
    hits: dict[str, list[WrkReport]] = {}
    pd: dict[str, PdRun] = {}
    try:
        if not args.skip_hits:
            hits = await bench_hits(
                cluster, args.seconds, args.rounds, args.connections, cluster.run_dir
            )
        if not args.skip_pd:
            for transport in ("tcp", "shm"):
                pd[transport] = await bench_pd(cluster, transport, args.pd_requests)
    finally:
        await asyncio.to_thread(cluster.down)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    if hits:
        print(
            f"\nHits through HAProxy, wrk 1 thread, {args.connections} connections, "
            f"{args.seconds} s per run; load {load}"
        )
        print(f"{'target':<14}{'req/s (runs)':<28}{'p50 ms':>8}{'p99 ms':>8}{'non-2xx':>9}")
        for name, rs in hits.items():
            rates = ", ".join(f"{r.rps:,.0f}" for r in rs)
            print(
                f"{name:<14}{rates:<28}{min(r.p50_ms for r in rs):>8.2f}"
                f"{min(r.p99_ms for r in rs):>8.2f}{sum(r.non_2xx for r in rs):>9}"
            )
        one = max(r.rps for r in hits["1 gateway"])
        two = max(r.rps for r in hits["2 gateways"])
        print(f"2 gateways / 1 gateway: {two / one:.2f}x (best run of each)")
    if pd:
        print(f"\nP/D through gw1, {args.pd_requests} prompts of ~600 tokens each, max_tokens 2")
        print(
            f"{'KV transport':<24}{'TTFT p50 ms':>12}{'p90 ms':>9}{'NIXL ms':>9}{'MB':>7}{'P/D':>7}"
        )
        for transport, run in pd.items():
            label = "UCX tcp over the veth" if transport == "tcp" else "UCX shared memory"
            print(
                f"{label:<24}{pct(run.ttft_s, 50) * 1000:>12.1f}{pct(run.ttft_s, 90) * 1000:>9.1f}"
                f"{run.xfer_s * 1000:>9.2f}{run.kv_bytes / 1e6:>7.2f}"
                f"{run.handed_off:>4}/{len(run.ttft_s)}   {', '.join(run.transports)}"
            )
    ok_hits = all(r.non_2xx == 0 for rs in hits.values() for r in rs)
    ok_pd = all(run.handed_off == len(run.ttft_s) for run in pd.values())
    return ok_hits and ok_pd


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5, help="length of one wrk run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--pd-requests", type=int, default=12)
    ap.add_argument("--skip-hits", action="store_true")
    ap.add_argument("--skip-pd", action="store_true")
    raise SystemExit(exit_status(main(ap.parse_args()), say))
