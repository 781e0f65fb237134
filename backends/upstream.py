"""The gateway → vLLM HTTP client: one pooled aiohttp session per backend, and its failures.

aiohttp rather than httpx on this path: httpx (over httpcore and anyio) enters a cancel scope
per socket read and costs several times more CPU per relayed request; on a shared core that
CPU delays the next request and splits vLLM's batches. Timeouts are socket-level
(``sock_connect``, ``sock_read``: the longest silence between two reads), never a total, so a
long stream is never cut while it makes progress.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp

from backends.protocol import BackendError

KEEPALIVE_S = 4.0
"""Idle pooled connections are dropped before uvicorn's (vLLM's) 5 s keep-alive closes them,
so a request is never sent on a connection the server is closing."""


def stream_timeout(read_s: float, connect_s: float) -> aiohttp.ClientTimeout:
    """No total; ``connect_s`` to connect, ``read_s`` of silence at most between two reads.

    ``connect`` (waiting for a pooled connection, then connecting) is bounded by ``read_s``,
    as httpx's pool timeout was.
    """
    return aiohttp.ClientTimeout(
        total=None, connect=read_s, sock_connect=connect_s, sock_read=read_s
    )


_BODY_WRITER = "ClientRequest.write_bytes"


def write_bodies_eagerly(loop: asyncio.AbstractEventLoop) -> None:
    """Let aiohttp send a request's body at once on Python 3.11, as it does on 3.12+.

    aiohttp writes a request's head and body from a task it starts eagerly on Python 3.12+
    ("to avoid having to schedule the task"); on 3.11 it is a plain task, which runs only
    after everything already queued on the loop. When several requests reach the gateway
    together, each one's upstream request then leaves only once all of them have been
    handled, so the first waits for the last (about 1.5 ms for 8 requests here). This loop
    task factory runs that one coroutine's first step inline, as ``eager_start`` would; every
    other task is created as before. Idempotent; nothing to do on 3.12+.
    """
    if sys.version_info >= (3, 12):
        return
    previous = loop.get_task_factory()
    if getattr(previous, "eager_bodies", False):
        return

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Future[Any]:
        if getattr(coro, "__qualname__", "") == _BODY_WRITER:
            return start_eagerly(loop, coro)
        if previous is not None:
            return previous(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    factory.eager_bodies = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)  # type: ignore[arg-type]


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]
) -> asyncio.Future[Any]:
    """Run ``coro`` up to its first suspension now; a task carries on from there.

    Returns a finished future when it did not suspend.
    """
    try:
        waiting = _claimed(coro.send(None))
    except StopIteration as stop:
        done = loop.create_future()
        done.set_result(stop.value)
        return done
    except BaseException as exc:
        failed = loop.create_future()
        failed.set_exception(exc)
        return failed
    return asyncio.Task(_resume(coro, waiting), loop=loop)


def _claimed(waiting: Any) -> Any:
    """Take over a yielded future as a task does: clear its "awaited" mark (a future refuses
    a second ``await`` while it is set), so that the driver can await it in turn."""
    if getattr(waiting, "_asyncio_future_blocking", False):
        waiting._asyncio_future_blocking = False
    return waiting


async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """Drive a started coroutine as its task would: wait for what it yielded, resume it."""
    while True:
        try:
            if waiting is None:  # a bare yield (asyncio.sleep(0))
                await asyncio.sleep(0)
            else:
                await waiting  # a future: the coroutine reads its result when resumed
        except BaseException as exc:  # cancellation included: the coroutine sees it
            try:
                waiting = _claimed(coro.throw(exc))
            except StopIteration as stop:
                return stop.value
        else:
            try:
                waiting = _claimed(coro.send(None))
            except StopIteration as stop:
                return stop.value


class HttpSession:
    """One pooled ``aiohttp.ClientSession`` for a backend's servers.

    The session is opened in the running event loop on first use (the backend clients are
    built before the server's loop runs) and closed by ``aclose``.
    """

    def __init__(self, *, max_connections: int, read_timeout_s: float, connect_timeout_s: float):
        self.max_connections = max_connections
        self.timeout = stream_timeout(read_timeout_s, connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            write_bodies_eagerly(asyncio.get_running_loop())
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self.timeout,
                cookie_jar=aiohttp.DummyCookieJar(),  # vLLM sets none; skip the parsing
                raise_for_status=False,
            )
        return self._session

    async def post(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        timeouts: aiohttp.ClientTimeout | None = None,
    ) -> aiohttp.ClientResponse:
        """POST ``body``; returns once the answer's headers are in (the body is not read).

        The wait for the headers is bounded by ``sock_read`` as a deadline: aiohttp's own
        ``sock_read`` timer is re-armed by data arriving at the same loop turn it fires, so a
        starved process would otherwise wait for a slow server's whole answer.
        """
        timeouts = timeouts or self.timeout
        async with asyncio.timeout(timeouts.sock_read):
            return await self.session.post(url, data=body, headers=headers, timeout=timeouts)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def raw_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body as it arrives: each read takes everything that has arrived so far.

    vLLM writes one SSE event per HTTP chunk, but when its engine outpaces its API server
    (small models, few cores) a whole answer can land in one burst. Taking what is already
    here in one piece makes such a burst one write to the client instead of one per event;
    nothing ever waits for more, and the events themselves are relayed byte for byte.
    """
    async for data in response.content.iter_any():
        yield data


HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
"""What talking to a server may raise (aiohttp's timeouts are ``TimeoutError``s)."""


def http_failure(exc: BaseException, url: str) -> BackendError:
    """The ``BackendError`` for an aiohttp exception (or timeout) talking to ``url``."""
    if isinstance(exc, asyncio.TimeoutError):  # ServerTimeoutError, ConnectionTimeoutError too
        return BackendError("timeout", f"backend {url} timed out", retry_after_s=1)
    if isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
        # refused, reset, disconnected, or the body cut short
        return BackendError("unreachable", f"backend {url} is unreachable", retry_after_s=2)
    return BackendError("broken", f"backend {url} failed: {type(exc).__name__}", retry_after_s=1)
