"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over the serving core.

A Messages request is answered as the chat completion it means (``translate.chat_request``)
on the core's generation path, route ``chat``: the same exact and semantic caches (an entry
serves a Messages request and the equivalent chat request alike), the same policy rule,
limits, placement and backends. Its answer is translated back: JSON by ``translate``, a
stream by ``events``, whether vLLM or the cache answered it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any, Final

import msgspec

from backends.registry import ModelInfo
from foundation.request import RequestContext
from foundation.sse import MEDIA_TYPE
from semcache import replay
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheResult
from server.anthropic.events import message_events
from server.anthropic.protocol import MessagesRequest, TokenCountRequest
from server.anthropic.translate import chat_request, message_body, tokenize_request
from server.errors import ApiError
from server.http.reply import SSE_HEADERS, ClosingStream, Reply, aclose_stream
from server.serving.cache_headers import CacheDirectives, edge_headers, reshaped, result_headers
from server.serving.cached_stream import replayed_reply
from server.serving.core import ServingCore
from server.serving.generation import Generation
from server.serving.stream_format import DataChunks
from server.serving.tokenization import Tokenization, upstream_error

CHAT_PATH = "/v1/chat/completions"


def anthropic_headers(headers: dict[str, str]) -> dict[str, str]:
    """The cache's headers of an answer translated from the stored chat completion: no
    validator nor content URL (they name the chat completion), and a ``Vary`` that names
    ``x-api-key`` too, the header Anthropic clients send their key in."""
    out = reshaped(headers)
    if "vary" in out:
        out["vary"] = "Authorization, x-api-key"
    return out


_EVENTS: Final = "_semcache_anthropic_events"
_MESSAGE: Final = "_semcache_anthropic_message"
"""An entry's Messages rendering, kept on the entry object (the memory tier hands out the same
object for every hit), as ``semcache.entry.entry_tag`` keeps its validator: a repeat is sent
without translating it again."""


def hit_reply(entry: CachedAnswer, res: CacheResult, creq: CacheRequest, stream: bool) -> Reply:
    """A fresh exact hit as the route sends it (the early hits' rendering of this route)."""
    if stream:
        kept = entry.__dict__.get(_EVENTS)
        if kept is None:
            rendered = MessagesServing.render(
                replayed_reply(entry, res, creq, True, DataChunks()), True
            )
            assert rendered.stream is not None
            rendered.stream = _remembered(rendered.stream, entry)
            return rendered
        said = anthropic_headers({**SSE_HEADERS, **result_headers(res, creq, stream=True)})
        headers = {**said, **SSE_HEADERS}  # as render() sends a replayed stream's
        return Reply(200, stream=_once(kept), media_type=MEDIA_TYPE, headers=headers)
    headers = {**result_headers(res, creq), **edge_headers(res, creq)}
    body = entry.__dict__.get(_MESSAGE)
    if body is None:
        body = entry.__dict__[_MESSAGE] = message_body(replay.as_json(entry, creq.route))
    return Reply(200, body, headers=anthropic_headers(headers))


async def _once(body: bytes) -> AsyncGenerator[bytes, None]:
    yield body


async def _remembered(
    events: AsyncIterable[bytes], entry: CachedAnswer
) -> AsyncGenerator[bytes, None]:
    """``events`` as they go out; once they ended with ``message_stop``, kept on ``entry``."""
    sent: list[bytes] = []
    try:
        async for chunk in events:
            sent.append(chunk)
            yield chunk
    finally:
        await aclose_stream(events)
    if sent and b"event: message_stop" in sent[-1]:
        entry.__dict__[_EVENTS] = b"".join(sent)


class MessagesServing:
    """Implements the Messages API (see the module doc)."""

    def __init__(self, core: ServingCore, generation: Generation, tokens: Tokenization) -> None:
        self.core = core
        self.generation = generation
        self.tokens = tokens

    async def create(
        self, body: dict[str, Any], ctx: RequestContext, directives: CacheDirectives | None = None
    ) -> Reply:
        req = msgspec.convert(body, MessagesRequest)
        info = self.core.resolve(req.model, "chat", ctx)
        chat = chat_request(req)
        stream = bool(req.stream)
        reply = await self.generation.generate(
            CHAT_PATH, "chat", info, chat, stream, ctx, directives
        )
        if reply.status != 200:
            raise upstream_error(reply)
        return self.render(reply, stream)

    @staticmethod
    def render(reply: Reply, stream: bool) -> Reply:
        """A chat completion's 200 reply (JSON, or its event stream) as a Messages answer."""
        headers = anthropic_headers(reply.headers)
        if reply.stream is None:
            if stream:
                raise ApiError(502, "The model did not stream its answer.", code="backend_error")
            return Reply(200, message_body(reply.body), headers=headers)
        events = ClosingStream(
            message_events(reply.stream), functools.partial(aclose_stream, reply.stream)
        )
        return Reply(200, stream=events, media_type=MEDIA_TYPE, headers={**headers, **SSE_HEADERS})

    async def count_tokens(
        self, body: dict[str, Any], ctx: RequestContext, directives: CacheDirectives | None = None
    ) -> Reply:
        """The prompt's tokens as the model's chat template renders it (vLLM's ``/tokenize``,
        through the exact cache like any tokenization)."""
        req = msgspec.convert(body, TokenCountRequest)
        info: ModelInfo = self.core.resolve(req.model, "chat", ctx)
        body = {"model": req.model, **tokenize_request(req)}
        count, said = await self.tokens.count(info, body, ctx, directives)
        return Reply(200, msgspec.json.encode({"input_tokens": count}), headers=said)
