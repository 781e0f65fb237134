"""Admin API: cache purge and policy reload, behind the admin token of the policy."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import orjson
from litestar import Request, Response, post

from semcache.keys import scope_for
from semcache.policy import PolicyHolder
from semcache.purge import PurgeResult
from semcache.semantic.records import PartitionKey
from server.apidoc.operation import SERVER_ERROR, Answer, RouteDoc, documented
from server.auth import bearer_token
from server.errors import ApiError
from server.openai.routing import parse_body
from server.openai.serving import OpenAIServing

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


def _authorize(request: Request[Any, Any, Any]) -> None:
    policy: PolicyHolder = request.app.state.policy
    token = policy.current.admin.resolve_token()
    given = bearer_token(request.headers)
    if not given:
        raise ApiError(401, "The admin API needs `Authorization: Bearer <admin token>`.")
    if token is None:
        raise ApiError(403, "The admin API is disabled: no admin token is configured.")
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise ApiError(403, "Wrong admin token.")


@post(
    "/admin/cache/purge",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Purge the cache",
            tag="Admin",
            description="By key (digest or short id), model, tenant, scope, tag, or all. "
            "Takes the policy's admin token.",
            body=PurgeRequest,
            answers=(Answer(200, PurgeResult, "The purge is applied."),),
            errors=(*ADMIN_ERRORS, 409),
        )
    ),
)
async def purge(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Purge by key (digest or short id), model, tenant, scope, tag, or all."""
    _authorize(request)
    req = msgspec.convert(parse_body(await request.body()), PurgeRequest)
    if req.kind != "all" and not req.target:
        raise ApiError(400, f"Purge by {req.kind} needs a `target`.", param="target")
    serving: OpenAIServing = request.app.state.serving
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
    return Response(orjson.dumps(msgspec.to_builtins(result)), media_type="application/json")


@post(
    "/admin/policy/reload",
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Reload the policy file",
            tag="Admin",
            description="An invalid file is a 400 and the current policy stays. "
            "Takes the policy's admin token.",
            answers=(Answer(200, PolicyReloaded, "The new policy is in force."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def reload_policy(request: Request[Any, Any, Any]) -> Response[bytes]:
    _authorize(request)
    policy: PolicyHolder = request.app.state.policy
    error = policy.reload()
    if error is not None:
        raise ApiError(400, f"The new policy is invalid; the current one stays: {error}")
    return Response(msgspec.json.encode(PolicyReloaded(True)), media_type="application/json")


ROUTES = [purge, reload_policy]
