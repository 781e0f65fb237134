"""Async OpenAI-protocol client for vLLM servers: one pooled httpx client per backend."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson

from backends.config import VllmBackend, VllmServer
from backends.protocol import BackendError, RequestContext, UpstreamResponse


def _failure(exc: Exception, url: str) -> BackendError:
    if isinstance(exc, httpx.TimeoutException):
        return BackendError("timeout", f"backend {url} timed out", retry_after_s=1)
    if isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError | httpx.ReadError):
        return BackendError("unreachable", f"backend {url} is unreachable", retry_after_s=2)
    return BackendError("broken", f"backend {url} failed: {type(exc).__name__}", retry_after_s=1)


class VllmStream:
    """A streamed answer relayed as raw bytes; closing it aborts the request in vLLM."""

    def __init__(self, response: httpx.Response, url: str, release: Callable[[], None]) -> None:
        self._response = response
        self._url = url
        self._release: Callable[[], None] | None = release
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "text/event-stream")

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise _failure(exc, self._url) from exc
        finally:
            await self.aclose()

    async def read_all(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise _failure(exc, self._url) from exc
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
        await self._response.aclose()


class VllmClient:
    """Sends OpenAI-protocol requests to the servers of one vLLM backend.

    Server choice here is the simplest that is correct for a monolithic pool (least
    outstanding requests, round-robin on ties); disaggregated routing plugs in above it.
    """

    def __init__(self, config: VllmBackend) -> None:
        self.config = config
        self.name = config.name
        self.served_model = config.served_model
        servers = [s for s in config.servers if s.role == "both"] or list(config.servers)
        if not servers:
            raise ValueError(f"backend {config.name!r} has no servers")
        self._servers = servers
        self._inflight = {s.url: 0 for s in servers}
        self._rr = itertools.count()
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=config.max_connections,
                max_keepalive_connections=config.max_connections,
            ),
        )

    def _pick(self) -> VllmServer:
        start = next(self._rr)
        n = len(self._servers)
        order = [self._servers[(start + i) % n] for i in range(n)]
        return min(order, key=lambda s: self._inflight[s.url])

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        server = self._pick()
        url = server.url.rstrip("/") + path
        self._inflight[server.url] += 1
        try:
            r = await self._http.post(
                url,
                content=orjson.dumps(body),
                headers={"content-type": "application/json", "x-request-id": ctx.request_id},
            )
        except httpx.HTTPError as exc:
            raise _failure(exc, server.url) from exc
        finally:
            self._inflight[server.url] -= 1
        return UpstreamResponse(
            status=r.status_code,
            body=r.content,
            content_type=r.headers.get("content-type", "application/json"),
        )

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> VllmStream:
        server = self._pick()
        url = server.url.rstrip("/") + path
        request = self._http.build_request(
            "POST",
            url,
            content=orjson.dumps(body),
            headers={
                "content-type": "application/json",
                "accept": "text/event-stream",
                "x-request-id": ctx.request_id,
            },
        )
        self._inflight[server.url] += 1

        def release() -> None:
            self._inflight[server.url] -= 1

        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            release()
            raise _failure(exc, server.url) from exc
        return VllmStream(response, server.url, release)

    def inflight(self) -> int:
        """Requests this client has open right now, on all its servers."""
        return sum(self._inflight.values())

    def has_capacity(self, per_server_limit: int | None = None) -> bool:
        """True when some server runs fewer requests than ``per_server_limit`` (a monolithic
        pool has no limit of its own: without one, always true)."""
        if per_server_limit is None:
            return True
        return any(n < per_server_limit for n in self._inflight.values())

    async def ready(self) -> bool:
        for s in self._servers:
            try:
                r = await self._http.get(s.url.rstrip("/") + "/health", timeout=2.0)
            except httpx.HTTPError:
                return False
            if r.status_code != 200:
                return False
        return True

    async def aclose(self) -> None:
        await self._http.aclose()
