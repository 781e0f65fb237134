"""``GET /v1/cache/{digest}``: a stored answer by its key digest, the ``Content-Location``
every cacheable answer names, for a client or an HTTP cache to read it again.

Scoped as the answer's key is: a tenant's answer is its own (another tenant gets the same
404 as for a key that does not exist); an answer shared by a policy rule (with every tenant,
or a share group's members) is readable by those it is shared with only where the rule
reveals hits and their age (``reveal``), since reading it says that someone stored it; an
API key scoped to some models sees only their answers. A purged or expired entry, or one of
a model revision no longer served, is a 404 too.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get

from foundation.request import RequestContext
from semcache import replay
from semcache.cache_keys import scope_for
from semcache.exact import CacheResult
from semcache.policy import Policy
from server.apidoc.operation import SERVER_ERROR, Answer, Field, RouteDoc, documented
from server.apidoc.request_headers import CONTEXT_HEADERS, STRING
from server.envelope.context import context
from server.errors import ApiError
from server.http.reply import Reply
from server.http.respond import respond
from server.identity.auth import model_allowed
from server.serving.cache_headers import edge_headers, status_headers
from server.serving.core import ServingCore
from server.serving.usage_notes import note_result

_HEX = frozenset("0123456789abcdef")


def _visible(res: CacheResult, route: str, policy: Policy, ctx: RequestContext) -> bool:
    key = res.key
    if key.scope == scope_for(ctx.tenant, shared=False):
        return True
    rule = policy.rule(key.model_id, route)
    said = {"status", "age"}.issubset(rule.reveal)
    return said and policy.scope(rule, ctx.tenant, ctx.token_id) == key.scope


@get(
    "/v1/cache/{digest:str}",
    operation_class=documented(
        RouteDoc(
            summary="Read a cached answer by its key",
            tag="Cache",
            description="The `Content-Location` every cacheable answer names: 64 hex digits.",
            headers=(
                *CONTEXT_HEADERS,
                Field("if-none-match", STRING, "The answer's ETag: 304 when it still matches."),
            ),
            answers=(
                Answer(200, {"type": "object"}, "The stored answer, as its route answered it."),
                Answer(304, None, "Not modified: the answer still has this ETag."),
            ),
            errors=(400, 401, 404, 429, *SERVER_ERROR),
        )
    ),
)
async def cached_answer(request: Request[Any, Any, Any]) -> Response[Any]:
    digest = str(request.path_params["digest"]).lower()
    if len(digest) != 64 or not set(digest) <= _HEX:
        raise ApiError(
            400,
            "A cache key is the 64 hex digits of an answer's digest (its Content-Location).",
            param="digest",
            code="invalid_value",
        )
    ctx = context(request)
    core: ServingCore = request.app.state.core
    res = await core.cache.lookup_digest(digest) if core.cache is not None else None
    info = core.registry.resolve(res.key.model_id) if res is not None else None
    if (
        res is None
        or res.entry is None
        or info is None
        or info.revision != res.key.revision
        or not _visible(res, res.entry.route, core.policy.current, ctx)
        or not model_allowed(ctx.models, info.id, info)
    ):
        raise ApiError(
            404,
            "No cached answer under this key: never stored, expired, purged or not yours.",
            code="cache_miss",
        )
    body = replay.as_json(res.entry, res.entry.route)
    note_result(ctx.usage, res)
    ctx.usage.model, ctx.usage.route = info.id, res.entry.route
    own = res.key.scope == scope_for(ctx.tenant, shared=False)
    saved = own or "saved" in core.policy.current.rule(info.id, res.entry.route).reveal
    said = status_headers(
        res.status, res.key.short_id, entry=res.entry, age_s=res.age_s, saved=saved
    )
    headers = {**said, **edge_headers(res)}
    reply = Reply(200, body, headers=headers)
    return respond(reply, ctx, if_none_match=request.headers.get("if-none-match"))


ROUTES = [cached_answer]
