"""Real local HTTP servers standing in for vLLM servers in the backend client's unit tests.

Each ``FakeServer`` listens on its own 127.0.0.1 port (aiohttp's web server) and answers with a
handler, so the client under test goes through its real HTTP stack: connection pool, timeouts,
refused connections, bodies cut short. A server can go down (nothing listens on its port, so
connections are refused) and come back on the same port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from harness.ports import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeServer:
    """One local HTTP server on a fixed port; ``start``/``stop`` bring it up and down."""

    def __init__(self, handler: Handler) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._handler = handler
        self._runner: web.AppRunner | None = None

    @property
    def up(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handler)
        # handler_cancellation: a handler that never answers ends when the client gives up
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1
        )
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._runner = runner

    async def stop(self) -> None:
        """Close the listening socket and every open connection: connections are refused."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        await runner.cleanup()
        for _ in range(3):  # let the clients' event loop see the closed keep-alive connections
            await asyncio.sleep(0)


async def sse(request: web.Request, *events: bytes) -> web.StreamResponse:
    """A 200 ``text/event-stream`` answer written one HTTP chunk per event."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    await response.write_eof()
    return response
