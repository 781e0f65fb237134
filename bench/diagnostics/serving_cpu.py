"""CPU of the gateway's own request path per chat request, in process: no HTTP, no sockets.

``OpenAIServing.chat`` in front of an in-process backend that answers at once (the answers
of ``gateway_cpu.py``'s fake vLLM: a JSON answer, or 18 SSE chunks, one event each), with
the answer cache off, then on (default tiers: memory + disk; every request a miss), and the
streamed answers read to the end. Prints the CPU time per request of the event loop's
thread (what delays other requests) and of the whole process (the disk tier's writer thread
included), best of ``--repeat`` runs, and what the cache adds. Without uvicorn, Litestar and
aiohttp, this isolates the serving and cache code, steadier than ``gateway_cpu.py`` on a
shared machine (its noise is about ±0.1 ms per request; the cache's share is less).

    .venv/bin/python -m bench.diagnostics.serving_cpu [--requests 3000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvloop
from prometheus_client import CollectorRegistry
from server.openai.serving import OpenAIServing

from backends.protocol import UpstreamResponse
from backends.registry import ModelInfo, ModelRegistry
from bench.diagnostics.gateway_cpu import _ANSWER, _EVENT, _FINAL, _LAST, TOKENS
from bench.overhead_lib.chat import chat_body
from foundation.request import RequestContext
from semcache.exact import open_exact_cache
from semcache.policy import PolicyHolder
from server.identity.auth import tenant_from
from server.metrics import GatewayMetrics
from server.serving.cache_headers import directives_from

CHUNKS = [b"data: " + _EVENT + b"\n\n"] * (TOKENS - 1) + [
    b"data: " + _FINAL + b"\n\n",
    b"data: " + _LAST + b"\n\n",
    b"data: [DONE]\n\n",
]
HEADERS = {"content-type": "application/json"}


class _Stream:
    status = 200
    content_type = "text/event-stream"

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in CHUNKS:
            await asyncio.sleep(0)  # each chunk in its own loop iteration, as from a socket
            yield chunk

    async def read_all(self) -> bytes:
        return b"".join(CHUNKS)

    async def aclose(self) -> None:
        return None


class _Backend:
    name = "fake"
    served_model = "fake-llama"

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        await asyncio.sleep(0)
        return UpstreamResponse(status=200, body=_ANSWER)

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> _Stream:
        await asyncio.sleep(0)
        return _Stream()

    async def ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


async def run(cache: bool, stream: bool, requests: int, concurrency: int) -> tuple[float, float]:
    """(event-loop thread, process) CPU µs per request."""
    registry = ModelRegistry()
    registry.generation["fake"] = _Backend()
    registry.add(ModelInfo("m", "chat", (), "t", "fake", "rev1", "tpl"))
    policy = PolicyHolder(None)
    metrics = GatewayMetrics(CollectorRegistry())
    serving = OpenAIServing(registry, metrics, policy)
    uids = iter(range(10**9))

    async def one() -> None:
        body = orjson.loads(chat_body("m", next(uids), TOKENS, stream))
        ctx = RequestContext(request_id="r", tenant=tenant_from(HEADERS))
        reply = await serving.chat(body, ctx, directives_from(HEADERS))
        if reply.stream is not None:
            async for _ in reply.stream:
                pass

    with tempfile.TemporaryDirectory(prefix="semcache-servingcpu-") as tmp:
        if cache:
            serving.cache = await open_exact_cache(
                policy.current.tiers, data_dir=tmp, registry=metrics.registry
            )
        try:
            for _ in range(200):  # warm-up
                await one()
            process, thread = time.process_time(), time.thread_time()
            for _ in range(requests // concurrency):
                await asyncio.gather(*(one() for _ in range(concurrency)))
            n = requests // concurrency * concurrency
            return 1e6 * (time.thread_time() - thread) / n, 1e6 * (
                time.process_time() - process
            ) / n
        finally:
            if serving.cache is not None:
                await serving.cache.aclose()


async def main(args: argparse.Namespace) -> None:
    print(f"serving + cache CPU per request, in process ({args.requests} requests per cell)")
    print(f"{'cell':16s}  loop thread: off      on  +cache   process: off      on  +cache  (us)")
    for stream in (False, True):
        for concurrency in (1, 8):
            best: dict[bool, tuple[float, float]] = {}
            for _ in range(args.repeat):
                for cache in (False, True):
                    got = await run(cache, stream, args.requests, concurrency)
                    old = best.get(cache)
                    best[cache] = got if old is None else (min(old[0], got[0]), min(old[1], got[1]))
            (off_t, off_p), (on_t, on_p) = best[False], best[True]
            label = f"{'stream' if stream else 'non-stream'} c={concurrency}"
            print(
                f"{label:16s} {off_t:13.1f} us {on_t:7.1f} {on_t - off_t:+7.1f}"
                f"   {off_p:13.1f} {on_p:7.1f} {on_p - off_p:+7.1f}",
                flush=True,
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="requests per cell and run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; the best counts")
    uvloop.run(main(ap.parse_args()))
