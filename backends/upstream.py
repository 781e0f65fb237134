"""The gateway → vLLM HTTP client: one pooled aiohttp session per backend, and its failures.

aiohttp rather than httpx on this path: httpx (over httpcore and anyio) enters a cancel scope
per socket read and costs several times more CPU per relayed request; on a shared core that
CPU delays the next request and splits vLLM's batches. Timeouts are socket-level
(``sock_connect``, ``sock_read``: the longest silence between two reads), never a total, so a
long stream is never cut while it makes progress.

A server whose host vanishes (powered off, unplugged) sends nothing back, not even a reset:
a request written on a pooled connection to it, or a stream waiting on it, would wait for the
whole read timeout. Every upstream socket therefore gives up on a peer whose kernel
acknowledges nothing for ``connect_timeout_s`` (Linux ``TCP_USER_TIMEOUT``) and probes an idle
connection (TCP keepalive), which a live peer's kernel answers however busy its server is.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp

from backends.interfaces import BackendError

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


SocketFactory = Callable[[tuple[int, int, int, str, tuple[str, int]]], socket.socket]


def dead_peer_sockets(dead_after_s: float) -> SocketFactory:
    """A socket factory for aiohttp whose TCP sockets fail once the peer's kernel has
    acknowledged nothing for ``dead_after_s`` (data sent, or keepalive probes on an idle
    connection). Platforms without these options get plain sockets."""
    seconds = max(1, round(dead_after_s))

    def make(addr_info: tuple[int, int, int, str, tuple[str, int]]) -> socket.socket:
        family, kind, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=kind, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_USER_TIMEOUT", seconds * 1000),
            ("TCP_KEEPIDLE", seconds),
            ("TCP_KEEPINTVL", 1),
            ("TCP_KEEPCNT", seconds),
        ):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        return sock

    return make


class HttpSession:
    """One pooled ``aiohttp.ClientSession`` for a backend's servers.

    The session is opened in the running event loop on first use (the backend clients are
    built before the server's loop runs) and closed by ``aclose``.
    """

    def __init__(self, *, max_connections: int, read_timeout_s: float, connect_timeout_s: float):
        self.max_connections = max_connections
        self.timeout = stream_timeout(read_timeout_s, connect_timeout_s)
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections,
                limit_per_host=0,
                keepalive_timeout=KEEPALIVE_S,
                socket_factory=dead_peer_sockets(self.connect_timeout_s),
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


def body_failure(exc: BaseException, url: str) -> BackendError:
    """The ``BackendError`` for an exception reading the body of an answer whose status came.

    The server answered, so it is reachable: a body cut short is this answer broken (vLLM
    closes the connection when its handler fails mid-stream), not the server gone, and does
    not eject it. A server that died is ejected by the next connection it refuses, or by its
    health check.
    """
    if isinstance(exc, asyncio.TimeoutError):
        return BackendError("timeout", f"backend {url} timed out", retry_after_s=1)
    return BackendError(
        "broken", f"backend {url} broke off its answer ({type(exc).__name__})", retry_after_s=1
    )
