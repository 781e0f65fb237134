"""Admin API of API keys: create, list, show, update, rotate, revoke; the audit log.

Thin routes over ``server.identity.api_keys.admin.KeyAdmin``; every one needs the admin role. A
secret is in an answer twice only: creating a key and rotating it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response, delete, get, patch, post
from litestar.params import FromPath

from server.admin.api_router import ADMIN_ERRORS
from server.apidoc.operation import Answer, Field, RouteDoc, documented
from server.envelope.context import record, require_admin
from server.errors import ApiError
from server.http.respond import parse_body
from server.identity.api_keys.admin import Actor, KeyAdmin
from server.identity.api_keys.records import (
    AuditEntry,
    CreatedKey,
    KeyCreate,
    KeyInfo,
    KeyRotate,
    KeyUpdate,
)


class KeyList(msgspec.Struct):
    data: list[KeyInfo]
    object: Literal["list"] = "list"


class AuditPage(msgspec.Struct):
    data: list[AuditEntry]
    object: Literal["list"] = "list"


class AuditQuery(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100


KEY_ERRORS = (*ADMIN_ERRORS, 404, 409)


def key_admin(request: Request[Any, Any, Any]) -> tuple[KeyAdmin, Actor]:
    """The key operations and who asks for them (the admin role checked)."""
    require_admin(request)
    keys: KeyAdmin | None = request.app.state.api_keys
    if keys is None:
        raise ApiError(
            409, "API keys are off on this gateway ([keys] enabled = false).", code="keys_disabled"
        )
    principal = record(request).principal
    return keys, Actor(principal.token_id, principal.tenant)


def _json(value: Any) -> Response[bytes]:
    return Response(msgspec.json.encode(value), media_type="application/json")


@post(
    "/admin/keys",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Create an API key",
            tag="API keys",
            description="A key of a tenant, with its roles, models, expiry, limits and "
            "metadata. The answer holds the secret: it is shown this once. "
            "Needs the admin role.",
            body=KeyCreate,
            answers=(Answer(200, CreatedKey, "The key and its secret."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def create_key(request: Request[Any, Any, Any]) -> Response[bytes]:
    keys, actor = key_admin(request)
    req = msgspec.convert(parse_body(await request.body()), KeyCreate)
    return _json(await keys.create(req, actor))


@get(
    "/admin/keys",
    opt={"auth": "admin"},
    operation_class=documented(
        RouteDoc(
            summary="List API keys",
            tag="API keys",
            description="Every key made through the API (revoked ones too), oldest first. "
            "Needs the admin role.",
            query=(Field("tenant", {"type": "string"}, "Only this tenant's keys."),),
            answers=(Answer(200, KeyList, "The keys, without their secrets."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def list_keys(request: Request[Any, Any, Any]) -> Response[bytes]:
    keys, _ = key_admin(request)
    return _json(KeyList(await keys.list_keys(request.query_params.get("tenant") or None)))


@get(
    "/admin/keys/{key_id:str}",
    opt={"auth": "admin"},
    operation_class=documented(
        RouteDoc(
            summary="Show an API key",
            tag="API keys",
            description="Needs the admin role.",
            answers=(Answer(200, KeyInfo, "The key, without its secret."),),
            errors=KEY_ERRORS,
        )
    ),
)
async def show_key(request: Request[Any, Any, Any], key_id: FromPath[str]) -> Response[bytes]:
    keys, _ = key_admin(request)
    return _json(await keys.show(key_id))


@patch(
    "/admin/keys/{key_id:str}",
    opt={"auth": "admin"},
    operation_class=documented(
        RouteDoc(
            summary="Update an API key",
            tag="API keys",
            description="The fields sent change (`null` clears `models`, `expires_at` or "
            "`limits`); every gateway applies it within a second. A token listed in the "
            "config cannot be changed (409). Needs the admin role.",
            body=KeyUpdate,
            answers=(Answer(200, KeyInfo, "The key as it is now."),),
            errors=KEY_ERRORS,
        )
    ),
)
async def update_key(request: Request[Any, Any, Any], key_id: FromPath[str]) -> Response[bytes]:
    keys, actor = key_admin(request)
    req = msgspec.convert(parse_body(await request.body()), KeyUpdate)
    return _json(await keys.update(key_id, req, actor))


@delete(
    "/admin/keys/{key_id:str}",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Revoke an API key",
            tag="API keys",
            description="Refused on every gateway within a second (401 `api_key_revoked`); "
            "the record stays, for the audit. A token listed in the config cannot be revoked "
            "here (409). Needs the admin role.",
            answers=(Answer(200, KeyInfo, "The key, revoked."),),
            errors=KEY_ERRORS,
        )
    ),
)
async def revoke_key(request: Request[Any, Any, Any], key_id: FromPath[str]) -> Response[bytes]:
    keys, actor = key_admin(request)
    return _json(await keys.revoke(key_id, actor))


@post(
    "/admin/keys/{key_id:str}/rotate",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Rotate an API key's secret",
            tag="API keys",
            description="A new secret (shown this once); the old one stays valid for "
            "`grace_s` seconds (default 0: not at all). Needs the admin role.",
            body=KeyRotate,
            answers=(Answer(200, CreatedKey, "The key and its new secret."),),
            errors=KEY_ERRORS,
        )
    ),
)
async def rotate_key(request: Request[Any, Any, Any], key_id: FromPath[str]) -> Response[bytes]:
    keys, actor = key_admin(request)
    raw = await request.body()
    req = msgspec.convert(parse_body(raw), KeyRotate) if raw.strip() else KeyRotate()
    return _json(await keys.rotate(key_id, req, actor))


@get(
    "/admin/audit",
    opt={"auth": "admin"},
    operation_class=documented(
        RouteDoc(
            summary="Read the audit log of API keys",
            tag="API keys",
            description="Every admin change of a key (who, what, when), newest first; never "
            "a secret. Needs the admin role.",
            query=(
                Field("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}, "Entries."),
            ),
            answers=(Answer(200, AuditPage, "The newest entries."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def audit_log(request: Request[Any, Any, Any]) -> Response[bytes]:
    keys, _ = key_admin(request)
    query = msgspec.convert(dict(request.query_params), AuditQuery, strict=False)
    return _json(AuditPage(await keys.audit_log(query.limit)))


ROUTES = [create_key, list_keys, show_key, update_key, revoke_key, rotate_key, audit_log]
