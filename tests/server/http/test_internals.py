"""The speed tricks that reach into uvicorn, Litestar and aiohttp (``server.http.internals``): each
still applies to the installed library, and does what it is for."""

from __future__ import annotations

import asyncio
import inspect
import re
import socket
import sys
import threading
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp.client_reqrep
import pytest
import uvicorn
from litestar import Litestar, get
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.testing import AsyncTestClient
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from backends.upstream import HttpSession
from harness.ports import free_port
from server.http import internals
from server.http.internals import HeadWithBody, start_eagerly, write_bodies_eagerly
from server.http.uvicorn_config import uvicorn_config

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"

# -- each trick still applies ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(internals.CHECKED))
def test_the_installed_version_is_one_the_tricks_were_checked_against(name: str) -> None:
    lower, upper = internals.SUPPORTED[name]
    installed = Version(version(name))
    assert Version(lower) <= installed < Version(upper), (
        f"{name} {installed} is outside [{lower}, {upper}): re-check server/http/internals.py's "
        f"tricks against it, then widen SUPPORTED and pyproject.toml together"
    )
    assert Version(lower) <= Version(internals.CHECKED[name]) < Version(upper)


@pytest.mark.parametrize("name", sorted(internals.CHECKED))
def test_pyproject_bounds_each_library_as_speedups_declares(name: str) -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == name]
    lower, upper = internals.SUPPORTED[name]
    assert {str(s) for s in req.specifier} == {f">={lower}", f"<{upper}"}


def test_uvicorn_cycles_still_write_through_a_swappable_transport() -> None:
    # GatewayHttpProtocol replaces the cycle's transport once uvicorn has made the cycle.
    assert inspect.signature(HttpToolsProtocol.on_headers_complete).parameters.keys() == {"self"}
    made = inspect.getsource(HttpToolsProtocol.on_headers_complete)
    assert "self.cycle = RequestResponseCycle(" in made
    assert "transport" in inspect.signature(RequestResponseCycle.__init__).parameters
    # HeadWithBody stands in for the transport: it must offer all the cycle uses of it.
    used = set(re.findall(r"self\.transport\.(\w+)", inspect.getsource(RequestResponseCycle)))
    assert used <= {"write", "close", "is_closing"}, used


def test_litestar_streams_still_send_their_body_through_a_swappable_class() -> None:
    # _RelayResponse swaps the class of the response Stream builds: same slots, send_body.
    params = list(inspect.signature(ASGIStreamingResponse.send_body).parameters)
    assert params == ["self", "send", "receive"]
    assert ASGIStreamingResponse.__slots__ == ("iterator",)
    assert internals._RelayResponse.__slots__ == ()
    assert internals._RelayResponse.__bases__ == (ASGIStreamingResponse,)
    assert "to_asgi_response" in vars(Stream)
    assert "self.send_body(send=send, receive=receive)" in inspect.getsource(ASGIResponse.__call__)


def test_litestar_still_hands_every_request_to_its_asgi_handler() -> None:
    # before_routing replaces app.asgi_handler: __call__ must still read it per request.
    source = inspect.getsource(Litestar.__call__)
    assert "await self.asgi_handler(scope, receive, self._wrap_send(send=send, scope=scope))" in (
        source
    )
    assert "self.asgi_handler = self._create_asgi_handler()" in inspect.getsource(Litestar)


async def test_a_layer_before_routing_sees_requests_before_the_router() -> None:
    seen: list[str] = []

    @get("/here", sync_to_thread=False)
    def here() -> str:
        seen.append("route")
        return "ok"

    app = Litestar([here])

    def layer(inner: Any) -> Any:
        async def call(scope: Any, receive: Any, send: Any) -> None:
            seen.append(f"layer {scope['path']} {type(scope['state']).__name__}")
            if scope["path"] == "/early":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"early"})
                return
            await inner(scope, receive, send)

        return call

    internals.before_routing(app, layer)
    async with AsyncTestClient(app) as client:
        assert (await client.get("/early")).text == "early"
        assert (await client.get("/here")).text == "ok"
    assert seen == ["layer /early dict", "layer /here dict", "route"]


def test_litestar_responses_still_have_the_slots_encoded_responses_fill() -> None:
    # _encoded builds an ASGIResponse by hand: every slot, nothing else.
    assert ASGIResponse.__slots__ == internals.ASGI_RESPONSE_SLOTS
    assert "self.encode_headers()" in inspect.getsource(ASGIResponse.start_response)
    assert "self.headers.headers" in inspect.getsource(ASGIResponse.encode_headers)


async def asgi_messages(response: ASGIResponse) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    await response({"type": "http"}, receive, send)  # type: ignore[arg-type]
    return sent


@pytest.mark.parametrize(
    ("status", "media_type", "headers"),
    [
        (200, "application/json", {"cache-control": "no-store", "X-Request-Id": "r1", "age": "3"}),
        (429, "application/json", {"retry-after": "1"}),
        (200, "text/plain", {"etag": '"é"'}),
        (200, "application/json", {"Content-Type": "application/x-ndjson"}),  # left to Litestar
        (304, "application/json", {"etag": '"x"'}),  # left to Litestar
    ],
)
async def test_an_encoded_response_sends_what_litestar_would(
    status: int, media_type: str, headers: dict[str, str]
) -> None:
    from litestar import Response

    body = b"" if status == 304 else b'{"a":1}'
    request: Any = None
    ours = internals.EncodedResponse(
        body, status_code=status, media_type=media_type, headers=headers
    )
    theirs = Response(body, status_code=status, media_type=media_type, headers=headers)
    layers: dict[str, Any] = {"headers": {}, "cookies": [], "status_code": 201}
    mine = await asgi_messages(ours.to_asgi_response(None, request, **layers))
    expected = await asgi_messages(theirs.to_asgi_response(None, request, **layers))
    assert mine == expected


async def test_an_encoded_response_leaves_the_routes_layered_headers_to_litestar() -> None:
    from litestar import Response

    request: Any = None
    layers: dict[str, Any] = {"headers": {"x-layer": "1"}, "cookies": []}
    ours = internals.EncodedResponse(b"{}", status_code=200, headers={"a": "b"})
    theirs = Response(b"{}", status_code=200, headers={"a": "b"})
    mine = await asgi_messages(ours.to_asgi_response(None, request, **layers))
    assert mine == await asgi_messages(theirs.to_asgi_response(None, request, **layers))
    assert (b"x-layer", b"1") in mine[0]["headers"]


def test_aiohttp_still_writes_bodies_from_the_coroutine_the_factory_watches() -> None:
    request = aiohttp.client_reqrep.ClientRequest
    owner, _, method = internals.BODY_WRITER.partition(".")
    assert request.__name__ == owner
    writer = getattr(request, method)
    assert inspect.iscoroutinefunction(writer)
    assert writer.__qualname__ == internals.BODY_WRITER
    send = inspect.getsource(request.send)
    assert f"self.{method}(" in send
    assert "asyncio.create_task(coro)" in send  # on 3.11: a plain task, from the factory


# -- uvicorn: the head goes out with the first body bytes -------------------------------


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_head_and_body_of_one_turn_go_out_in_one_write() -> None:
    raw = Transport()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert raw.writes == []
    t.write(b"body")
    assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    t.write(b"more")  # later writes pass through
    assert raw.writes[-1] == b"more"
    await asyncio.sleep(0)
    assert len(raw.writes) == 2


async def test_a_lone_head_goes_out_at_the_end_of_the_turn() -> None:
    raw = Transport()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"head")
    await asyncio.sleep(0)
    assert raw.writes == [b"head"]
    t.write(b"chunk")  # a stream's chunks are never held
    assert raw.writes == [b"head", b"chunk"]


async def test_close_sends_what_is_held_first() -> None:
    raw = Transport()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"head")
    t.close()
    assert raw.writes == [b"head"] and raw.closed
    await asyncio.sleep(0)
    assert raw.writes == [b"head"]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_real_server_answers_whole(method: str) -> None:
    unused_port = free_port()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b" world", "more_body": False})

    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", unused_port))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn has no event)
        await asyncio.sleep(0.01)
    try:
        for _ in range(2):  # keep-alive: two requests on one connection
            reader, writer = await asyncio.open_connection("127.0.0.1", unused_port)
            writer.write(f"{method} / HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and b"x-a: 1" in head
            if method == "GET":
                body = await reader.readuntil(b"0\r\n\r\n")
                assert body == b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            writer.close()
    finally:
        server.should_exit = True
        await task


# -- Litestar: a stream sent from the request's task ------------------------------------


async def test_relay_response_ends_quietly_when_the_client_leaves() -> None:
    from collections.abc import AsyncIterator

    from litestar.background_tasks import BackgroundTask

    from server.http.reply import Reply
    from server.http.respond import respond

    closed = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    stream = endless()
    response = respond(Reply(200, stream=stream, media_type="text/event-stream"))
    assert isinstance(response.background, BackgroundTask)
    asgi = response.to_asgi_response(app=None, request=None)  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 4:
            gone.set()

    await asyncio.wait_for(asgi({"type": "http"}, receive, send), 5)  # type: ignore[arg-type]
    assert closed.is_set()  # the background task closed the stream: the backend is aborted
    assert sent[0]["type"] == "http.response.start"
    assert all(m.get("more_body") for m in sent[1:])  # cut, not ended
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_relay_response_sends_the_whole_stream() -> None:
    from collections.abc import AsyncIterator

    from server.http.reply import Reply
    from server.http.respond import respond

    async def three() -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"%d" % i

    response = respond(Reply(200, stream=three(), media_type="text/event-stream"))
    asgi = response.to_asgi_response(app=None, request=None)  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            done.set()

    await asyncio.wait_for(asgi({"type": "http"}, receive, send), 5)  # type: ignore[arg-type]
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"0", b"1", b"2", b""]
    assert sent[-1]["more_body"] is False


# -- aiohttp: a request's body leaves at once on Python 3.11 -----------------------------


async def test_a_coroutine_that_does_not_suspend_finishes_inside_start() -> None:
    ran: list[str] = []

    async def quick() -> int:
        ran.append("body")
        return 7

    future = start_eagerly(asyncio.get_running_loop(), quick())
    assert ran == ["body"]  # before any loop turn
    assert future.done() and future.result() == 7


async def test_a_suspended_coroutine_carries_on_as_a_task() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[int] = loop.create_future()
    steps: list[str] = []

    async def slow() -> int:
        steps.append("first")
        await asyncio.sleep(0)
        steps.append("after yield")
        value = await gate
        steps.append("after future")
        return value + 1

    task = start_eagerly(loop, slow())
    assert steps == ["first"]
    loop.call_soon(gate.set_result, 41)
    assert await task == 42
    assert steps == ["first", "after yield", "after future"]


async def test_errors_and_cancellation_reach_the_coroutine() -> None:
    loop = asyncio.get_running_loop()
    failing: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    async def waits(fut: asyncio.Future[None]) -> None:
        try:
            await fut
        except ValueError:
            seen.append("error")
            raise
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = start_eagerly(loop, waits(failing))
    failing.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        await task
    blocked: asyncio.Future[None] = loop.create_future()
    task = start_eagerly(loop, waits(blocked))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["error", "cancelled"]
    assert blocked.cancelled()  # as a task cancels the future it waits for


async def test_only_aiohttp_body_writers_start_eagerly() -> None:
    loop = asyncio.get_running_loop()
    before = loop.get_task_factory()
    try:
        write_bodies_eagerly(loop)
        write_bodies_eagerly(loop)  # idempotent
        ran: list[str] = []

        async def other() -> None:
            ran.append("other")

        task = asyncio.create_task(other())
        assert ran == []  # ordinary tasks are scheduled as usual
        await task
        assert ran == ["other"]
    finally:
        loop.set_task_factory(before)


class _RecordingServer:
    """A bare TCP server in a thread: counts the requests whose bytes are all in (``arrived``
    is set at each), answers 200."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.arrived = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            while data := conn.recv(65536):
                if data.endswith(b"{}"):  # head and body are in: answer
                    self.requests += 1
                    self.arrived.set()
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: 2\r\n\r\n{}"
                    )

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("eager", [True, False])
async def test_a_request_leaves_before_the_work_queued_behind_it(eager: bool) -> None:
    """A handler posts upstream while another handler's work is already queued on the loop:
    with eager bodies the request is on the wire before that work runs, not after it."""
    if not eager and sys.version_info >= (3, 12):
        pytest.skip("aiohttp starts its body writer eagerly itself on 3.12+")
    loop = asyncio.get_running_loop()
    before = loop.get_task_factory()
    server = _RecordingServer()
    if eager:
        write_bodies_eagerly(loop)  # as the app's lifespan does
    http = HttpSession(max_connections=1, read_timeout_s=10, connect_timeout_s=5)
    try:
        url = f"http://127.0.0.1:{server.port}/v1/x"
        headers = {"content-type": "application/json"}
        await (await http.post(url, b"{}", headers)).read()  # connect (pooled from now on)
        if not eager:  # the control: aiohttp's own behaviour on this Python
            loop.set_task_factory(None)
        server.arrived.clear()
        arrived_while_busy: list[bool] = []

        def busy() -> None:
            """Another request's CPU-bound handling, queued before ours: it holds the loop
            until our request has reached the server (eager), or for as long as the control
            needs to show that it cannot (the body is written from a task of the loop)."""
            arrived_while_busy.append(server.arrived.wait(timeout=30 if eager else 0.2))

        loop.call_soon(busy)
        response = await http.post(url, b"{}", headers)
        await response.read()
        assert server.requests == 2
        assert arrived_while_busy == [eager]
    finally:
        await http.aclose()
        loop.set_task_factory(before)
        server.close()


def test_an_encoded_response_skips_litestars_header_building(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ASGIResponse.__init__ ran: the fast path no longer applies")

    monkeypatch.setattr(ASGIResponse, "__init__", refuse)
    request: Any = None
    ours = internals.EncodedResponse(b"{}", status_code=200, headers={"a": "b"})
    built = ours.to_asgi_response(None, request, headers={}, cookies=[], status_code=201)
    assert built.status_code == 200 and built.body == b"{}"


@pytest.mark.parametrize("route_media_type", [None, "application/json"])
@pytest.mark.parametrize(
    "headers", [{"cache-control": "no-store", "X-Accel-Buffering": "no"}, {"content-type": "x/y"}]
)
def test_a_relay_stream_starts_as_litestars_stream_would(
    route_media_type: str | None, headers: dict[str, str]
) -> None:
    from collections.abc import AsyncIterator

    from litestar.background_tasks import BackgroundTask

    async def events() -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"

    async def done() -> None:
        pass

    request: Any = None
    layers: dict[str, Any] = {"headers": {}, "cookies": [], "media_type": route_media_type}
    built = []
    for cls in (internals.RelayStream, Stream):
        stream = cls(
            events(),
            status_code=200,
            media_type="text/event-stream",
            headers=headers,
            background=BackgroundTask(done),
        )
        built.append(stream.to_asgi_response(None, request, **layers))
    ours, theirs = built
    assert type(ours) is internals._RelayResponse
    assert ours.encode_headers() == theirs.encode_headers()
    assert (ours.status_code, ours.body, ours.is_head_response) == (200, b"", False)
    assert isinstance(ours.background, BackgroundTask)
    for name in ("content_length", "encoding"):
        assert getattr(ours, name) == getattr(theirs, name)
