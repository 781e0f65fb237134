"""The upstream HTTP client: eager body writes (Python 3.11's stand-in for eager_start) and
how a streamed body is read."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.upstream import HttpSession, raw_chunks, start_eagerly, write_bodies_eagerly

pytestmark = pytest.mark.asyncio


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
    """A bare TCP server in a thread: notes when each request's bytes arrive, answers 200."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.arrivals: list[float] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            while data := conn.recv(65536):
                self.arrivals.append(time.monotonic())
                if data.endswith(b"{}"):  # head and body are in: answer
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
    http = HttpSession(max_connections=1, read_timeout_s=10, connect_timeout_s=5)
    try:
        url = f"http://127.0.0.1:{server.port}/v1/x"
        headers = {"content-type": "application/json"}
        await (await http.post(url, b"{}", headers)).read()  # connect (pooled from now on)
        if not eager:  # the control: aiohttp's own behaviour on this Python
            loop.set_task_factory(None)
        server.arrivals.clear()
        blocked_until = 0.0

        def busy() -> None:  # another request's CPU-bound handling, queued before ours
            nonlocal blocked_until
            time.sleep(0.1)
            blocked_until = time.monotonic()

        loop.call_soon(busy)
        response = await http.post(url, b"{}", headers)
        await response.read()
        assert len(server.arrivals) == 1
        if eager:
            assert server.arrivals[0] < blocked_until - 0.05
        else:
            assert server.arrivals[0] >= blocked_until
    finally:
        await http.aclose()
        loop.set_task_factory(before)
        server.close()


def event(i: int) -> bytes:
    return b'data: {"n": %d}\n\n' % i


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def sse_response(handler: Handler) -> AsyncIterator[aiohttp.ClientResponse]:
    """The client's response to a POST answered by ``handler`` on a local aiohttp server."""
    app = web.Application()
    app.router.add_post("/stream", handler)
    server = TestServer(app)
    await server.start_server()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(server.make_url("/stream")) as response,
        ):
            yield response
    finally:
        await server.close()


async def chunked(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    return response


async def test_a_burst_already_here_is_one_piece_and_later_events_come_as_they_arrive() -> None:
    release, sent = asyncio.Event(), asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        """Events 0-4 as five HTTP chunks, then 5 once ``release`` is set, then the end."""
        response = await chunked(request)
        for i in range(5):
            await response.write(event(i))
        sent.set()
        await release.wait()
        await response.write(event(5))
        await response.write_eof()
        return response

    async with sse_response(handler) as response:
        await sent.wait()
        await asyncio.sleep(0.1)  # the five chunks reach the client's buffer
        pieces = raw_chunks(response)
        burst = await anext(pieces)
        assert burst == b"".join(event(i) for i in range(5))
        # nothing more is here: the next read waits for the server, not for a fuller piece
        later = asyncio.ensure_future(anext(pieces))
        await asyncio.sleep(0.05)
        assert not later.done()
        release.set()
        assert await later == event(5)
        assert [p async for p in pieces] == []


async def test_a_body_cut_short_is_relayed_up_to_the_cut_then_raises() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = await chunked(request)
        await response.write(event(0))
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # mid-body: the chunked encoding never ends
        return response

    async with sse_response(handler) as response:
        got: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async for piece in raw_chunks(response):
                got.append(piece)
        assert got == [event(0)]
