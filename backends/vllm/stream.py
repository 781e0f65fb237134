"""A streamed vLLM answer relayed as raw bytes, and the look at its first event.

The decode hop reads the first SSE event before committing to a server, so that a server
failing early (vLLM's error event, e.g. a failed KV pull) can still be replaced.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson

from backends.interfaces import BackendError
from backends.upstream import HTTP_ERRORS, body_failure, raw_chunks
from foundation.sse import SSEReader


class VllmStream:
    """A streamed answer relayed as raw bytes; closing it aborts the request in vLLM.

    ``head`` holds bytes already read (the first event, read while a retry was still
    possible); they are yielded first.
    """

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        url: str,
        release: Callable[[], None],
        *,
        head: bytes = b"",
        rest: AsyncIterator[bytes] | None = None,
        on_failure: Callable[[BackendError], None] | None = None,
    ) -> None:
        self._response = response
        self._url = url
        self._release: Callable[[], None] | None = release
        self._head = head
        self._rest = rest
        self._on_failure = on_failure
        self.status = response.status
        self.content_type = response.headers.get("content-type", "text/event-stream")

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self._head:
                yield self._head
            async for chunk in self._rest or raw_chunks(self._response):
                yield chunk
        except HTTP_ERRORS as exc:
            failure = body_failure(exc, self._url)
            if self._on_failure is not None:
                self._on_failure(failure)
            raise failure from exc
        finally:
            await self.aclose()

    async def read_all(self) -> bytes:
        try:
            if self._rest is None:
                return self._head + await self._response.read()
            return self._head + b"".join([chunk async for chunk in self._rest])
        except HTTP_ERRORS as exc:
            raise body_failure(exc, self._url) from exc
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
        # Back to the pool when read to the end; otherwise the connection is closed, which
        # makes vLLM abort the request.
        self._response.release()


_BEFORE_GENERATION = (b'"type":"response.created"', b'"type":"response.in_progress"')
"""Responses API events vLLM sends before its engine has produced anything."""


def _generated(payload: bytes) -> bool:
    return not any(kind in payload for kind in _BEFORE_GENERATION)


async def read_first_event(
    response: aiohttp.ClientResponse,
) -> tuple[bytes, AsyncIterator[bytes]]:
    """Bytes up to the end of the first data event the engine produced (or of the stream),
    and the rest.

    A Responses API stream's ``response.created`` and ``response.in_progress`` come before
    the engine ran; the head goes on to the next event, so that it always follows the first
    generated token (after a P/D hand-off: after the KV pull).
    """
    rest = raw_chunks(response)
    head = b""
    reader = SSEReader()
    async for chunk in rest:
        head += chunk
        if any(_generated(payload) for payload in reader.feed(chunk)):
            break
    return head, rest


def is_server_error_event(head: bytes) -> bool:
    """The first event is vLLM's ``{"error": {..., "code": 5xx}}`` (e.g. a failed KV pull)."""
    payloads = SSEReader().feed(head + b"\n\n")  # a stream may end without the blank line
    return any(_is_server_error(payload) for payload in payloads)


def _is_server_error(raw: bytes) -> bool:
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return not isinstance(code, int) or code >= 500
