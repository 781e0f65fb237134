"""The dashboard's keys page: every API key with its spend against its budgets and its last
use, and the forms that create (the secret shown once, in the answer only) and revoke.

The forms post JSON to ``/dashboard/api/actions/keys/new`` and ``…/{id}/revoke`` with
``x-semcache-dashboard: 1`` (as the purge form does), through the admin API's own
operations, so they are audited alike.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.params import FromPath

from server.errors import ApiError
from server.http.respond import parse_body
from server.identity.api_keys.admin import Actor, KeyAdmin
from server.identity.api_keys.records import KeyCreate
from server.identity.auth import Principal, TokenAuth

KEYS_NOTE = "API keys are off on this gateway ([keys] enabled = false)"


def _admin(request: Request[Any, Any, Any]) -> tuple[KeyAdmin, Actor]:
    """The key operations and the admin who asks (the dashboard authenticates itself)."""
    auth: TokenAuth = request.app.state.auth
    principal: Principal = auth.authenticate(request.headers, key_required=True)
    if not principal.admin:
        raise ApiError(403, "This route needs a token with the admin role.")
    if request.headers.get("x-semcache-dashboard") != "1":
        raise ApiError(403, "Changes from the dashboard need `x-semcache-dashboard: 1`.")
    keys: KeyAdmin | None = request.app.state.api_keys
    if keys is None:
        raise ApiError(409, KEYS_NOTE, code="keys_disabled")
    return keys, Actor(principal.token_id, principal.tenant)


async def keys_page(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The page's data (the caller has checked the admin role): each key with its own spend
    against its own budgets (``KeyInfo.spend``)."""
    keys: KeyAdmin | None = request.app.state.api_keys
    if keys is None:
        return {"keys": [], "note": KEYS_NOTE}
    rows = [
        {**msgspec.to_builtins(info), "budgets": msgspec.to_builtins(info.spend or [])}
        for info in await keys.list_keys(request.query_params.get("tenant") or None)
    ]
    return {"keys": rows, "note": None}


@post("/api/actions/keys/new", status_code=200)
async def create_key(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The create form: the answer holds the secret, which no page ever shows again."""
    keys, actor = _admin(request)
    req = msgspec.convert(parse_body(await request.body()), KeyCreate)
    made = await keys.create(req, actor)
    return Response(msgspec.json.encode(made), media_type="application/json")


@post("/api/actions/keys/{key_id:str}/revoke", status_code=200)
async def revoke_key(request: Request[Any, Any, Any], key_id: FromPath[str]) -> Response[bytes]:
    keys, actor = _admin(request)
    return Response(
        msgspec.json.encode(await keys.revoke(key_id, actor)), media_type="application/json"
    )


ROUTES = [create_key, revoke_key]
