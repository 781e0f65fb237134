"""A Gemini-shaped surface: ``POST /mini/v1/generate`` ``{"model", "contents"}`` →
``{"text"}``; the key in ``x-goog-api-key`` or ``?key=``; errors as
``{"error": {"code", "message", "status"}}``."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final

import msgspec
import orjson
from litestar import Request, Response, post

from foundation.request import RequestContext
from semcache import replay
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheResult
from server.apidoc.operation import CLIENT_ERRORS, Answer, RouteDoc, documented
from server.envelope.context import context
from server.errors import ApiError, ErrorFormat
from server.http.reply import Reply
from server.http.respond import parse_body, respond
from server.serving.cache_headers import CacheDirectives, directives_from, result_headers
from server.serving.core import ServingCore
from server.serving.generation import Generation
from server.surface import Services, Surface, Watched

PATH: Final = "/mini/v1/generate"


class MiniErrorDetail(msgspec.Struct):
    code: int
    message: str
    status: str


class MiniError(msgspec.Struct):
    error: MiniErrorDetail


def render_error(err: ApiError) -> tuple[int, bytes]:
    try:
        status = HTTPStatus(err.status).name
    except ValueError:
        status = "UNKNOWN"
    return err.status, msgspec.json.encode(
        MiniError(MiniErrorDetail(err.status, err.message, status))
    )


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    contents: str


class Generated(msgspec.Struct):
    text: str


def text_of(chat_completion: bytes) -> bytes:
    doc = orjson.loads(chat_completion)
    return msgspec.json.encode(Generated(doc["choices"][0]["message"]["content"] or ""))


class MiniServing:
    def __init__(self, core: ServingCore, generation: Generation) -> None:
        self.core = core
        self.generation = generation

    async def generate(
        self, body: dict[str, Any], ctx: RequestContext, directives: CacheDirectives
    ) -> Reply:
        req = msgspec.convert(body, GenerateRequest)
        info = self.core.resolve(req.model, "chat", ctx)
        chat = {
            "model": req.model,
            "messages": [{"role": "user", "content": req.contents}],
            "temperature": 0,
        }
        reply = await self.generation.generate(
            "/v1/chat/completions", "chat", info, chat, False, ctx, directives
        )
        if reply.status != 200:
            raise ApiError(reply.status, "The model failed.")
        return Reply(200, text_of(reply.body), headers=reply.headers)


def hit_reply(entry: CachedAnswer, res: CacheResult, creq: CacheRequest, stream: bool) -> Reply:
    return Reply(200, text_of(replay.as_json(entry, creq.route)), headers=result_headers(res, creq))


@post(
    PATH,
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Generate (a small Gemini-shaped surface)",
            tag="Mini",
            body=GenerateRequest,
            answers=(Answer(200, Generated, "The text."),),
            errors=(*CLIENT_ERRORS, 404),
        )
    ),
)
async def generate(request: Request[Any, Any, Any]) -> Response[Any]:
    serving: MiniServing = request.app.state.mini
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await serving.generate(body, ctx, directives_from(request.headers))
    return respond(reply, ctx)


def build(services: Services) -> Mapping[str, Any]:
    return {"mini": MiniServing(services.core, services.generation)}


SURFACE: Final = Surface(
    name="Mini",
    prefixes=("/mini",),
    routes=(generate,),
    errors=ErrorFormat(MiniError, render_error),
    key_headers=("x-goog-api-key",),
    key_query=("key",),
    early_hits={PATH: Watched("chat", "chat", hit_reply)},
    build=build,
)
