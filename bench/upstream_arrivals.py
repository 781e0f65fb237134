"""When a wave of concurrent requests reaches vLLM: sent straight to it, or through the gateway.

A fake vLLM (an aiohttp server in its own process, pinned to core 1 when there is one) notes
the moment each chat request arrives; the gateway (``python -m server.cli serve --no-launch``)
and this load client share the other core, as in ``overhead.py``. Waves of ``--concurrency``
requests alternate between the fake itself and the gateway in front of it. For each target it
prints, over the waves: the median request's arrival after the wave was sent, and the spread
from the first arrival to the last. The gateway's extra delay is what it costs before a
request leaves; a spread near zero through the gateway means its requests leave together,
only once all of them have been handled.

    .venv/bin/python bench/upstream_arrivals.py [--waves 100] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
from aiohttp import web

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_cpu import _ANSWER, _EVENT, _FINAL, _LAST, SERVED, TOKENS
from bench.overhead import GATEWAY_MODEL_ID, GatewayProcess, chat_body, gateway_toml
from tests.support.vllm import free_port

UID = re.compile(rb'"content":"(\d{7})\.')


def serve_fake(port: int) -> None:
    """The fake vLLM on ``port``; ``GET /arrivals`` hands over (and forgets) what it noted."""
    arrivals: dict[str, float] = {}

    async def chat(request: web.Request) -> web.StreamResponse:
        at = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
        raw = await request.read()
        found = UID.search(raw)
        if found:
            arrivals[found.group(1).decode()] = at
        if not orjson.loads(raw).get("stream"):
            return web.Response(body=_ANSWER, content_type="application/json")
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(TOKENS):
            await response.write(b"data: " + (_FINAL if i == TOKENS - 1 else _EVENT) + b"\n\n")
        await response.write(b"data: " + _LAST + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async def taken(request: web.Request) -> web.Response:
        out = dict(arrivals)
        arrivals.clear()
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def empty(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        card = {"id": SERVED, "object": "model", "max_model_len": 2048}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/arrivals", taken)
    app.router.add_get("/health", empty)
    app.router.add_get("/metrics", empty)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def measure(args: argparse.Namespace, fake_url: str) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="semcache-arrivals-") as tmp_name:
        tmp = Path(tmp_name)
        config = tmp / "gateway.toml"
        config.write_text(
            gateway_toml(
                data_dir=tmp, port=port, vllm_url=fake_url, served=SERVED, model=None, cache=True
            )
        )
        gateway = GatewayProcess(config, port, tmp / "gateway.log")
        gateway.start()
        try:
            await gateway.wait_ready()
            async with aiohttp.ClientSession() as client:
                await run_waves(client, fake_url, gateway.url, args.waves, args.concurrency)
        finally:
            await gateway.stop()


async def run_waves(
    client: aiohttp.ClientSession, fake: str, gateway: str, waves: int, concurrency: int
) -> None:
    uids = iter(range(10**7))
    targets = {"direct": (fake, SERVED), "gateway": (gateway, GATEWAY_MODEL_ID)}

    async def one(base: str, model: str, stream: bool) -> int:
        uid = next(uids)
        body = chat_body(model, uid, TOKENS, stream)
        headers = {"content-type": "application/json"}
        async with client.post(f"{base}/v1/chat/completions", data=body, headers=headers) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{base} answered {r.status}")
        return uid

    print(f"arrival at the upstream of a wave of {concurrency} requests ({waves} waves, medians)")
    for stream in (False, True):
        medians: dict[str, list[float]] = {name: [] for name in targets}
        spreads: dict[str, list[float]] = {name: [] for name in targets}
        for wave in range(-3, waves):  # three warm-up waves
            order = list(targets) if wave % 2 == 0 else list(targets)[::-1]
            for name in order:
                base, model = targets[name]
                sent = time.monotonic()
                uids_sent = await asyncio.gather(
                    *(one(base, model, stream) for _ in range(concurrency))
                )
                async with client.get(f"{fake}/arrivals") as r:
                    noted = orjson.loads(await r.read())
                at = sorted(noted[f"{u:07d}"] - sent for u in uids_sent)
                if wave >= 0:
                    medians[name].append(float(np.median(at)))
                    spreads[name].append(at[-1] - at[0])
        label = "stream" if stream else "non-stream"
        for name in targets:
            print(
                f"  {label:10s} {name:8s} median arrival {1e3 * np.median(medians[name]):5.2f} ms"
                f"   first to last {1e3 * np.median(spreads[name]):5.2f} ms"
                f"   (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--waves", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.serve_fake:
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[-1]})
        serve_fake(args.serve_fake)
        return 0
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[:-1]))  # the gateway (started below) inherits it
    fake_port = free_port()
    fake = subprocess.Popen(
        [sys.executable, __file__, "--serve-fake", str(fake_port)],
        preexec_fn=lambda: os.sched_setaffinity(0, set(cores)),
    )
    try:
        time.sleep(1.5)
        asyncio.run(measure(args, f"http://127.0.0.1:{fake_port}"))
    finally:
        fake.terminate()
        fake.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
