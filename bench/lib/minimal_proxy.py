"""A minimal reverse proxy for chat completions: the floor of a Python gateway's overhead.

aiohttp's server and client, nothing else: no framework, no cache, no validation, no
metrics. ``bench/overhead.py --minimal-proxy`` measures it in the gateway's place, so the
gateway's figures can be read against what any Python proxy costs in the same layout.

    .venv/bin/python bench/lib/minimal_proxy.py PORT UPSTREAM_URL SERVED_MODEL
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import orjson
import uvloop
from aiohttp import web


async def serve(port: int, upstream: str, served: str) -> None:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64, limit_per_host=0, keepalive_timeout=4),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
    )

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        body["model"] = served
        up = await session.post(
            f"{upstream}/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"content-type": "application/json"},
        )
        if not body.get("stream"):
            data = await up.read()
            up.release()
            return web.Response(body=data, status=up.status, content_type="application/json")
        response = web.StreamResponse(
            status=up.status, headers={"content-type": "text/event-stream"}
        )
        await response.prepare(request)
        async for data in up.content.iter_any():  # what has arrived, in one write
            await response.write(data)
        up.release()
        await response.write_eof()
        return response

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), sys.argv[2].rstrip("/"), sys.argv[3]))
