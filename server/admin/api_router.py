"""Admin API: cache purge, policy reload and the request log, for the admin role."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
import orjson
from litestar import Request, Response, get, post

from semcache.cache_keys import scope_for
from semcache.exact.purge import PurgeResult
from semcache.policy import PolicyHolder
from semcache.semantic.records import PartitionKey
from server.apidoc.operation import SERVER_ERROR, Answer, RouteDoc, documented, query_fields
from server.envelope.context import require_admin
from server.envelope.middleware import Envelope
from server.errors import ApiError
from server.http.respond import parse_body
from server.serving.core import ServingCore

PurgeKind = Literal["key", "model", "tenant", "scope", "tag", "all"]


class PurgeRequest(msgspec.Struct, forbid_unknown_fields=True):
    kind: PurgeKind
    target: str = ""


class PolicyReloaded(msgspec.Struct):
    reloaded: bool


ADMIN_ERRORS = (400, 401, 403, 413, *SERVER_ERROR)


def semantic_purge_predicate(kind: str, target: str) -> Callable[[PartitionKey], bool]:
    """Which semantic partitions a purge drops (key and tag purges are checked per item)."""
    match kind:
        case "all":
            return lambda _key: True
        case "model":
            return lambda key: key.model_revision.startswith(f"{target}@")
        case "tenant":
            scope = scope_for(target, shared=False)
            return lambda key: key.scope == scope
        case "scope":
            return lambda key: key.scope == target
        case _:
            return lambda _key: False


@post(
    "/admin/cache/purge",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Purge the cache",
            tag="Admin",
            description="By key (digest or short id), model, tenant, scope, tag, or all. "
            "Needs the admin role.",
            body=PurgeRequest,
            answers=(Answer(200, PurgeResult, "The purge is applied."),),
            errors=(*ADMIN_ERRORS, 409),
        )
    ),
)
async def purge(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Purge by key (digest or short id), model, tenant, scope, tag, or all."""
    require_admin(request)
    req = msgspec.convert(parse_body(await request.body()), PurgeRequest)
    if req.kind != "all" and not req.target:
        raise ApiError(400, f"Purge by {req.kind} needs a `target`.", param="target")
    result = await purge_caches(request.app.state.core, req)
    return Response(orjson.dumps(msgspec.to_builtins(result)), media_type="application/json")


async def purge_caches(serving: ServingCore, req: PurgeRequest) -> PurgeResult:
    """The exact and semantic caches purged (the admin API's and the dashboard's purge)."""
    if serving.cache is None:
        raise ApiError(409, "The cache is disabled on this gateway.", code="cache_disabled")
    try:
        result = await serving.cache.purge(req.kind, req.target)
    except ValueError as exc:  # a key that is no digest
        raise ApiError(
            400, f"Invalid `target`: {exc}.", param="target", code="invalid_value"
        ) from None
    if serving.semantic is not None:
        # The purge already hides semantic entries (their partition and item keys carry the
        # purge epochs); dropping the partitions frees their memory at once.
        await serving.semantic.purge(semantic_purge_predicate(req.kind, req.target))
    return result


@post(
    "/admin/policy/reload",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Reload the policy file",
            tag="Admin",
            description="An invalid file is a 400 and the current policy stays. "
            "Needs the admin role.",
            answers=(Answer(200, PolicyReloaded, "The new policy is in force."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def reload_policy(request: Request[Any, Any, Any]) -> Response[bytes]:
    require_admin(request)
    policy: PolicyHolder = request.app.state.policy
    error = policy.reload()
    if error is not None:
        raise ApiError(400, f"The new policy is invalid; the current one stays: {error}")
    return Response(msgspec.json.encode(PolicyReloaded(True)), media_type="application/json")


class LogQuery(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tenant: str | None = None
    status: int | None = None
    model: str | None = None
    since: float | None = None
    """Seconds since the epoch."""
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100


LOG_PAGE = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"type": "object"}},
    },
}


@get(
    "/admin/logs",
    opt={"auth": "admin"},
    operation_class=documented(
        RouteDoc(
            summary="Read the request log",
            tag="Admin",
            description="The newest lines first, filtered by tenant, status, model and time "
            "(`since`: seconds since the epoch). Needs the admin role.",
            query=query_fields(LogQuery),
            answers=(Answer(200, LOG_PAGE, "The matching lines of the request log."),),
            errors=(*ADMIN_ERRORS, 409),
        )
    ),
)
async def logs(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The request log's newest lines, filtered by tenant, status, model and time."""
    require_admin(request)
    query = msgspec.convert(dict(request.query_params), LogQuery, strict=False)
    tenancy: Envelope = request.app.state.envelope
    if tenancy.request_log is None:
        raise ApiError(409, "The request log is off on this gateway.", code="request_log_off")
    lines = tenancy.request_log.query(
        tenant=query.tenant,
        status=query.status,
        model=query.model,
        since=query.since,
        limit=query.limit,
    )
    return Response(orjson.dumps({"object": "list", "data": lines}), media_type="application/json")


ROUTES = [purge, reload_policy, logs]
