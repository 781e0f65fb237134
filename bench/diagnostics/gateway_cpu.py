"""Gateway CPU per request, without a model: the gateway in front of a fake vLLM.

The fake (``harness.fake_vllm``, in its own process) answers chat completions like vLLM does,
at once: a JSON answer, or 16 content events (the last with its finish reason), a usage event
and ``[DONE]``, one HTTP chunk each (1 ms apart): complete answers, which the cache stores. With
no model competing for the cores, the gateway's CPU time per request (user + system, read
with psutil) is a steadier figure than latency on a shared machine; it is what the gateway
adds to every request. Write system calls per request (``/proc/PID/io``) are steadier still.
Cells: non-stream and stream, 1 and 8 concurrent; the answer cache is on (every request a
miss) unless ``--no-cache``. ``--burst``: the fake writes each stream's chunks back to back,
as vLLM does when its engine outpaces its API server (the tiny model on two unpinned cores).

    .venv/bin/python -m bench.diagnostics.gateway_cpu [--requests 200] [--no-cache] [--burst]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import httpx
import psutil

from bench.lib.cpu_probe import PACE_S, TOKENS, fake_process, fake_vllm, gateway_before
from bench.lib.overhead.chat import chat_body
from bench.lib.support import GATEWAY_MODEL_ID


async def measure(args: argparse.Namespace, fake_url: str) -> None:
    async with gateway_before(fake_url, cache=not args.no_cache) as gw:
        await run_cells(gw.url, psutil.Process(gw.pid), args.requests)


async def run_cells(base: str, server: psutil.Process, requests: int) -> None:
    uids = iter(range(10**9))
    headers = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:

        async def one(stream: bool) -> None:
            body = chat_body(GATEWAY_MODEL_ID, next(uids), TOKENS, stream)
            url = f"{base}/v1/chat/completions"
            async with client.stream("POST", url, content=body, headers=headers) as r:
                await r.aread()
                if r.status_code != 200:
                    raise RuntimeError(f"gateway answered {r.status_code}: {r.text[:200]}")

        print(f"gateway CPU per request (fake vLLM, {requests} requests per cell)")
        for stream in (False, True):
            for concurrency in (1, 8):
                for _ in range(10):  # warm-up
                    await one(stream)
                cpu = sum(server.cpu_times()[:2])
                writes = server.io_counters().write_count
                started = time.perf_counter()
                for _ in range(requests // concurrency):
                    await asyncio.gather(*(one(stream) for _ in range(concurrency)))
                n = requests // concurrency * concurrency
                per_request = 1e3 * (sum(server.cpu_times()[:2]) - cpu) / n
                writes_per_request = (server.io_counters().write_count - writes) / n
                wall = 1e3 * (time.perf_counter() - started) / n
                label = f"{'stream' if stream else 'non-stream'} c={concurrency}"
                print(
                    f"  {label:16s} {per_request:6.2f} ms CPU/req  {writes_per_request:5.1f} "
                    f"writes/req  ({wall:.1f} ms wall/req, load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per cell")
    ap.add_argument("--no-cache", action="store_true", help="gateway answer cache off")
    ap.add_argument(
        "--burst", action="store_true", help="the fake writes each stream's chunks back to back"
    )
    ap.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fake:
        fake_vllm(0.0 if args.burst else PACE_S, port=args.serve_fake).serve_forever()
        return 0
    with fake_process(__spec__.name, extra=["--burst"] if args.burst else []) as fake_url:
        asyncio.run(measure(args, fake_url))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
