"""Target (b): a bare Litestar app sending back the gateway's hit answers byte for byte, run
the way ``server.cli serve`` runs the gateway."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

from bench.lib.exact_hit.targets import Target
from bench.lib.exact_hit.workload import BODIES, PATHS, REQUEST_HEADERS, STREAM_MARK, Kind

DROPPED_HEADERS = {"date", "server", "content-length", "content-type", "transfer-encoding"}
"""Headers uvicorn/Litestar write themselves; the bare app copies the gateway's other ones."""


class CannedReply(msgspec.Struct, kw_only=True):
    """One answer as the gateway sent it on a hit: headers and body (SSE events for a stream)."""

    headers: dict[str, str]
    chunks: list[bytes]


class CannedReplies(msgspec.Struct, kw_only=True):
    json: CannedReply
    stream: CannedReply
    embeddings: CannedReply


def bare_app(replies: CannedReplies) -> Litestar:
    """The ceiling of this stack: read the body, send the gateway's bytes back, nothing else."""
    body = b"".join(replies.json.chunks)
    vectors = b"".join(replies.embeddings.chunks)

    async def events() -> AsyncIterator[bytes]:
        for chunk in replies.stream.chunks:  # one write per SSE event, as the gateway does
            yield chunk

    @post("/v1/chat/completions")
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        raw = await request.body()
        if STREAM_MARK in raw:
            return Stream(
                events(),
                status_code=200,
                media_type="text/event-stream",
                headers=replies.stream.headers,
            )
        return Response(
            body, status_code=200, media_type="application/json", headers=replies.json.headers
        )

    @post("/v1/embeddings")
    async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
        await request.body()
        return Response(
            vectors,
            status_code=200,
            media_type="application/json",
            headers=replies.embeddings.headers,
        )

    @get("/ready", sync_to_thread=False)
    def ready() -> dict[str, str]:
        return {"status": "ready"}

    # As the gateway's factory builds its Litestar (no OpenAPI, no logging config).
    return Litestar(
        route_handlers=[chat, embeddings, ready], openapi_config=None, logging_config=None
    )


def serve_bare(port: int, replies_path: Path) -> None:
    """Run the bare app the way ``server.cli serve`` runs the gateway."""
    replies = msgspec.json.decode(replies_path.read_bytes(), type=CannedReplies)
    server = uvicorn.Server(
        uvicorn.Config(
            bare_app(replies), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve())


async def canned_replies(gateway: Target) -> CannedReplies:
    """The gateway's hit answers, to be sent back by the bare app byte for byte."""

    def kept(headers: httpx.Headers) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k.lower() not in DROPPED_HEADERS}

    async def plain(kind: Kind) -> CannedReply:
        url = gateway.url + PATHS[kind]
        r = await client.post(url, content=BODIES[kind], headers=REQUEST_HEADERS)
        return CannedReply(headers=kept(r.headers), chunks=[r.content])

    client, url = gateway.client, gateway.url + PATHS["sse"]
    async with client.stream("POST", url, content=BODIES["sse"], headers=REQUEST_HEADERS) as s:
        raw = await s.aread()
        headers = kept(s.headers)
    events = [e + b"\n\n" for e in raw.split(b"\n\n") if e.strip()]
    return CannedReplies(
        json=await plain("json"),
        stream=CannedReply(headers=headers, chunks=events),
        embeddings=await plain("embeddings"),
    )
