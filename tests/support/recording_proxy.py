"""A recording HTTP proxy in front of a real vLLM server: every request body it forwards is
kept, so a test reads what the backend received (the answers are vLLM's own, streamed).

It serves from an event loop of its own, in a thread: the tests that read it are sync and
block on their own requests, so the proxy cannot share their loop."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
from aiohttp import web

from harness.ports import free_port


class RecordingProxy:
    """Forwards every request to ``target`` and keeps the bodies of the POSTs."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        if request.method == "POST":
            self.bodies.append(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with self._session.request(
            request.method, self.target + request.rel_url.path_qs, data=body, headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name in ("content-type",):
                if name in upstream.headers:
                    response.headers[name] = upstream.headers[name]
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def start(self) -> RecordingProxy:
        """Serve from the proxy's thread; returns once it listens."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def received(self) -> bytes:
        """Everything the backend was sent, as one blob to search."""
        return b"\n".join(self.bodies)
