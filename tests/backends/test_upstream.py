"""The upstream HTTP client: how a streamed body is read."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.upstream import HttpSession, raw_chunks
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.asyncio


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

    five = b"".join(event(i) for i in range(5))
    async with sse_response(handler) as response:
        await sent.wait()
        # the five chunks reach the client's buffer
        await wait_until_async(lambda: response.content.total_bytes >= len(five), timeout_s=5.0)
        pieces = raw_chunks(response)
        burst = await anext(pieces)
        assert burst == five
        # nothing more is here: the next read waits for the server, not for a fuller piece
        later = asyncio.ensure_future(anext(pieces))
        for _ in range(5):  # loop turns, not time: nothing more comes until ``release``
            await asyncio.sleep(0)
        assert not later.done()
        release.set()
        assert await later == event(5)
        assert [p async for p in pieces] == []


async def test_a_body_cut_short_is_relayed_up_to_the_cut_then_raises() -> None:
    relayed = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = await chunked(request)
        await response.write(event(0))
        await relayed.wait()  # the client has the first event; then the cut
        assert request.transport is not None
        request.transport.close()  # mid-body: the chunked encoding never ends
        return response

    async with sse_response(handler) as response:
        got: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async for piece in raw_chunks(response):
                got.append(piece)
                relayed.set()
        assert got == [event(0)]


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux socket options")
async def test_upstream_sockets_give_up_on_a_peer_that_acknowledges_nothing() -> None:
    """A vanished host sends no reset: the socket itself must time out (the cluster test
    ``test_the_decode_host_stops_503_with_retry_after_never_a_hang`` unplugs one)."""

    checked = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)  # the headers go out; the body waits for the check
        await checked.wait()
        await response.write(b"ok")
        return response

    app = web.Application()
    app.router.add_post("/", held)
    server = TestServer(app)
    await server.start_server()
    http = HttpSession(max_connections=4, read_timeout_s=600.0, connect_timeout_s=5.0)
    try:
        response = await http.post(str(server.make_url("/")), b"{}", {})
        assert response.connection is not None
        sock = response.connection.transport.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 5000
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
        checked.set()
        assert await response.text() == "ok"
    finally:
        checked.set()
        await http.aclose()
        await server.close()
