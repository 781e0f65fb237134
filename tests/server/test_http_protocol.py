"""The gateway's uvicorn protocol: a response's head goes out with its first body bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn

from backends.harness.ports import free_port
from server.http_protocol import HeadWithBody, uvicorn_config


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


async def test_relay_response_ends_quietly_when_the_client_leaves() -> None:
    from collections.abc import AsyncIterator

    from litestar.background_tasks import BackgroundTask

    from server.routes.openai import respond
    from server.serving import Reply

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

    from server.routes.openai import respond
    from server.serving import Reply

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
