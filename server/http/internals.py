"""Every speed trick that reaches into another library's internals, in one place.

- uvicorn (httptools protocol): a response's head waits for its first body bytes, so that
  both go out in one write (``GatewayHttpProtocol``, ``HeadWithBody``).
- Litestar: a streamed response sent from the request's own task, without Litestar's task
  group and cancel scope (``RelayStream``, ``_RelayResponse``); a complete body's headers
  encoded once, straight into the ASGI message (``EncodedResponse``); a layer that sees
  requests before the router does (``before_routing``).
- aiohttp: on Python 3.11, a request's body writer starts at once, as aiohttp does itself
  on 3.12+ (``write_bodies_eagerly``, installed on the loop by the app's lifespan).

Checked against uvicorn 0.54.0, Litestar 2.25.0 and aiohttp 3.14.5 (``CHECKED``);
pyproject.toml bounds the three to those minor versions (``SUPPORTED``), and
``tests/server/http/test_internals.py`` fails when a trick no longer applies: re-read the
internals each trick names before widening a bound.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterable, Callable, Coroutine, Mapping
from typing import Any, Final

from litestar import Litestar, Response
from litestar.datastructures import MutableScopeHeaders
from litestar.enums import MediaType
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import ASGIApp, Receive, Send
from litestar.utils.helpers import get_enum_string_value
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

CHECKED: Final = {"uvicorn": "0.54.0", "litestar": "2.25.0", "aiohttp": "3.14.5"}
"""The versions whose internals these tricks were read against."""

SUPPORTED: Final = {
    "uvicorn": ("0.54", "0.55"),
    "litestar": ("2.25", "2.26"),
    "aiohttp": ("3.14", "3.15"),
}
"""``[lower, upper)`` per library, as pyproject.toml declares them."""


# -- uvicorn: the head goes out with the first body bytes -------------------------------


class HeadWithBody:
    """The transport as one response cycle sees it: its first write waits for its second.

    uvicorn writes each ASGI message to the socket as it comes: a JSON answer goes out as two
    writes, the status line and headers, then the body. On loopback each write is a send
    system call that also runs the receiver's TCP path, and wakes the client twice. Here the
    first write of a response waits until the next write of the same response, or at most
    until the end of the event loop's turn, and both go out in one send: a JSON answer
    becomes one write, and nothing is held longer than the current turn (a streamed answer's
    head goes out before its first chunk is awaited).
    """

    __slots__ = ("_held", "_loop", "_passing", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._passing = False

    def write(self, data: bytes) -> None:
        if self._passing:
            self._transport.write(data)
        elif self._held is None:
            self._held = data
            self._loop.call_soon(self.flush)  # never held past this turn of the loop
        else:
            self._passing = True
            held, self._held = self._held, None
            self._transport.write(held + data)

    def flush(self) -> None:
        self._passing = True
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()
        self._transport.close()


class GatewayHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` whose response cycles write through ``HeadWithBody``."""

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not previous:
            # The cycle's ASGI task is created, not yet run: it writes through the wrapper.
            cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]


# -- Litestar: a stream sent from the request's task ------------------------------------


class _RelayResponse(ASGIStreamingResponse):
    """Litestar's streaming response, without its anyio task group and cancel scope.

    Litestar streams from a child task and cancels a cancel scope once the stream ends (a
    task group, a spawned task, the scope's cancellation, for every stream). Here the
    request's task sends the chunks itself and one watcher task waits for the client's
    disconnect, which cancels the sending as Litestar's scope did. The first chunk is sent in
    the same turn of the loop as the head (uvicorn's protocol then writes them together).
    """

    __slots__ = ()

    async def send_body(self, send: Send, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        sending = True
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if sending:
                gone = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for chunk in self.iterator:
                body = chunk if isinstance(chunk, bytes) else chunk.encode(self.encoding)
                await send({"type": "http.response.body", "body": body, "more_body": True})
            sending = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client has gone: the response ends quietly, as Litestar's did
        finally:
            sending = False
            watcher.cancel()


class RelayStream(Stream):
    """A ``Stream`` sent by ``_RelayResponse``; its headers encoded as ``EncodedResponse``
    encodes them, when Litestar would add nothing of its own but the content type."""

    def to_asgi_response(self, app: Any, request: Any, **kwargs: Any) -> ASGIResponse:
        if (
            app is None
            and not any(kwargs.get(k) for k in _LAYERED if k != "background")
            and not self.cookies
            and self.status_code is not None
            and isinstance(self.iterator, AsyncIterable)
        ):
            media_type = kwargs.get("media_type") or self.media_type  # Stream's precedence
            headers = encoded_headers(self.headers, media_type, self.encoding, None)
            if headers is not None:
                relay = _RelayResponse.__new__(_RelayResponse)
                _fill(relay, headers, self.status_code, self.encoding, b"", 0)
                relay.background = self.background or kwargs.get("background")
                relay.iterator = self.iterator
                return relay
        response = super().to_asgi_response(app, request, **kwargs)
        response.__class__ = _RelayResponse  # same slots: only send_body differs
        return response


ASGI_RESPONSE_SLOTS: Final = (
    "_encoded_cookies",
    "background",
    "body",
    "content_length",
    "encoding",
    "headers",
    "is_head_response",
    "status_code",
)
"""What ``_encoded`` fills of an ``ASGIResponse`` (its ``__slots__`` in Litestar 2.25)."""

_OWN_HEADERS: Final = frozenset({"content-type", "content-length"})


class EncodedResponse(Response[bytes]):
    """A ``Response`` of complete bytes whose ASGI response is built without Litestar's
    ``MutableScopeHeaders``: each header is encoded once, as Litestar encodes it (the name
    lower-cased, both latin-1), then ``content-type`` and ``content-length`` as Litestar adds
    them. Anything this does not cover (cookies, background tasks, headers or cookies from
    the route's layers, a HEAD request, a status without a body, a content type set by hand)
    is left to Litestar."""

    def to_asgi_response(self, app: Any, request: Any, **kwargs: Any) -> ASGIResponse:
        if app is None and not any(kwargs.get(k) for k in _LAYERED) and self._plain():
            response = _encoded(self, kwargs.get("media_type"))
            if response is not None:
                return response
        return super().to_asgi_response(app, request, **kwargs)

    def _plain(self) -> bool:
        status = self.status_code
        return (
            status is not None
            and isinstance(self.content, bytes)
            and not self.cookies
            and self.background is None
            and status >= 200
            and status not in (204, 304)
        )


_LAYERED: Final = ("background", "cookies", "encoded_headers", "headers", "is_head_response")


def _encoded(response: EncodedResponse, media_type: Any) -> ASGIResponse | None:
    body = response.content
    media_type = response.media_type or media_type  # Response's precedence
    headers = encoded_headers(response.headers, media_type, response.encoding, len(body))
    if headers is None:
        return None
    out = ASGIResponse.__new__(ASGIResponse)
    _fill(out, headers, response.status_code or 200, response.encoding, body, len(body))
    out.background = None
    return out


def encoded_headers(
    headers: Mapping[str, str], media_type: Any, encoding: str, content_length: int | None
) -> list[tuple[bytes, bytes]] | None:
    """``headers`` as Litestar's ``ASGIResponse`` encodes them, then the content type and
    length it adds; ``None`` when ``headers`` set either itself (left to Litestar)."""
    out: list[tuple[bytes, bytes]] = []
    for name, value in headers.items():
        low = name.lower()
        if low in _OWN_HEADERS:
            return None
        out.append((low.encode("latin-1"), value.encode("latin-1")))
    media = str(get_enum_string_value(media_type or MediaType.JSON))
    if media.startswith("text/"):
        media = f"{media}; charset={encoding}"
    out.append((b"content-type", media.encode("latin-1")))
    if content_length is not None:
        out.append((b"content-length", str(content_length).encode("latin-1")))
    return out


def _fill(
    response: ASGIResponse,
    headers: list[tuple[bytes, bytes]],
    status: int,
    encoding: str,
    body: bytes,
    content_length: int,
) -> None:
    """Set the slots of ``ASGI_RESPONSE_SLOTS`` but ``background``."""
    response._encoded_cookies = ()
    response.body = body
    response.content_length = content_length
    response.encoding = encoding
    response.headers = MutableScopeHeaders({"headers": headers})
    response.is_head_response = False
    response.status_code = status


# -- Litestar: a layer before routing ---------------------------------------------------


def before_routing(app: Litestar, wrap: Callable[[ASGIApp], ASGIApp]) -> None:
    """Put ``wrap``'s layer in front of Litestar's router (and its exception handler).

    ``Litestar.__call__`` sets ``scope["app"]`` and ``scope["state"]``, then hands every
    HTTP request to ``app.asgi_handler``, the router inside the exception handler, built
    once in ``__init__``. A layer put there sees each request before it is routed and
    passes it on by calling the handler it wraps; what it answers itself never reaches
    Litestar's middleware or exception handlers.
    """
    app.asgi_handler = wrap(app.asgi_handler)


# -- aiohttp: a request's body leaves at once on Python 3.11 -----------------------------

BODY_WRITER: Final = "ClientRequest.write_bytes"
"""The qualname of the coroutine aiohttp writes a request's body with."""


def write_bodies_eagerly(loop: asyncio.AbstractEventLoop) -> None:
    """Let aiohttp send a request's body at once on Python 3.11, as it does on 3.12+.

    aiohttp writes a request's head and body from a task it starts eagerly on Python 3.12+
    ("to avoid having to schedule the task"); on 3.11 it is a plain task, which runs only
    after everything already queued on the loop. When several requests reach the gateway
    together, each one's upstream request then leaves only once all of them have been
    handled, so the first waits for the last. This loop task factory runs that one
    coroutine's first step inline, as ``eager_start`` would; every other task is created as
    before. Idempotent; nothing to do on 3.12+.
    """
    if sys.version_info >= (3, 12):
        return
    previous = loop.get_task_factory()
    if getattr(previous, "eager_bodies", False):
        return

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Future[Any]:
        if getattr(coro, "__qualname__", "") == BODY_WRITER:
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
