"""Graceful shutdown on SIGTERM: finish what is in flight, refuse new work with 503, then exit.

On SIGTERM `semcache serve` keeps its socket open and *drains*: requests already admitted
(streams included) run to their end; a new request gets 503 with ``Retry-After`` and
``Connection: close``, in its route's own error format, and ``/ready`` answers 503, so a
load balancer sends the traffic elsewhere. Once nothing admitted is in flight, or after
``server.drain_timeout_s``, uvicorn's own shutdown runs: the socket closes (a new
connection is refused from then on), requests still running get ``GRACE_S`` more seconds,
the lifespan closes the caches and the backends, and the process exits with status 0.
A second SIGTERM ends the drain at once; Ctrl-C (SIGINT) keeps uvicorn's behaviour.

What a surface answers while draining is its own (``Surface.refusal``, its error format
otherwise); the health surface keeps ``/health`` and ``/metrics`` answering (the process is
alive and its metrics are worth scraping until the end) and says ``draining`` on ``/ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from types import FrameType

import uvicorn
from litestar.types import Send

from server.errors import ApiError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2
"""What a refused request is told: retry soon (another instance behind the balancer)."""

GRACE_S = 5.0
"""After the drain, how long uvicorn waits for requests still running before cancelling."""


class Drain:
    """Counts the requests in flight; once draining, says when none is left."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.refused = 0
        """Requests answered 503 because the gateway was draining."""
        self._idle: asyncio.Event | None = None

    def begin(self) -> None:
        """Stop admitting requests (call on the event loop)."""
        self.draining = True
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing admitted is in flight; False when ``timeout_s`` ran out first."""
        if self._idle is None:
            self.begin()
        assert self._idle is not None
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


REFUSAL = ApiError(
    503,
    "The gateway is shutting down; retry the request (another instance will answer it).",
    code="shutting_down",
    retry_after_s=RETRY_AFTER_S,
)


async def refuse(body: bytes, send: Send) -> None:
    """The 503 a request gets while the gateway drains: ``body`` is ``REFUSAL`` in its
    route's own format (``Surfaces.refusal``)."""
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER_S).encode()),
                (b"cache-control", b"no-store"),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = int(GRACE_S)
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drainer: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            if self._drainer is not None:
                self._drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._drainer

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = sig == signal.SIGTERM and not self.drain.draining and not self.should_exit
        if first and self._loop is not None and self.started:
            # Not recorded as a captured signal: uvicorn would raise it again once stopped,
            # and the process would die of it instead of exiting with 0.
            self._loop.call_soon_threadsafe(self._begin_drain)
            return
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        self.drain.begin()
        log.warning(
            "SIGTERM: draining, %d request(s) in flight; new ones get 503", self.drain.in_flight
        )
        self._drainer = asyncio.create_task(self._drain_then_exit(), name="semcache-drain")

    async def _drain_then_exit(self) -> None:
        if await self.drain.wait_idle(self.drain_timeout_s):
            log.warning("drained; stopping (%d request(s) refused meanwhile)", self.drain.refused)
        else:
            log.warning(
                "drain timeout (%.0fs): %d request(s) still in flight get %.0fs more",
                self.drain_timeout_s,
                self.drain.in_flight,
                GRACE_S,
            )
        self.should_exit = True
