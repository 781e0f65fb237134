"""Admin API of the vLLM pools: their servers and signals; servers join and drain at run time.

A server added joins its pool after one health check
(``backends.vllm.client.VllmClient.add_server``); a server drained takes nothing new and
leaves once its in-flight requests have finished (``backends.fleet.pool.Pool.drain``).
Neither is written to the config: each is kept in the pool membership store (``[pools]``,
server/membership/), which a restarted gateway and, on a shared Redis, every other gateway
applies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath

from backends.config import ServerRole
from backends.fleet.pool import Pool
from backends.fleet.pool_signals import PoolSignals, pool_signals
from backends.fleet.server_state import ServerState
from backends.registry import ModelRegistry
from backends.vllm.client import VllmClient
from server.admin.api_router import ADMIN_ERRORS
from server.apidoc.operation import Answer, Field, RouteDoc, documented
from server.envelope.context import require_admin
from server.errors import ApiError
from server.http.respond import parse_body
from server.pools.records import MemberState
from server.pools.sync import PoolMembership

ROLES: tuple[ServerRole, ...] = ("both", "prefill", "decode")
ServerStateName = Literal["serving", "ejected", "draining"]


class ServerView(msgspec.Struct):
    url: str
    role: str
    state: ServerStateName
    inflight: int
    limit: int
    requests: int
    ejections: int


class PoolView(msgspec.Struct):
    backend: str
    role: str
    servers: list[ServerView]
    signals: PoolSignals


class PoolList(msgspec.Struct):
    data: list[PoolView]
    object: Literal["list"] = "list"


class AddServer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    """``http(s)://host:port`` of a running vLLM server of the backend's model."""
    max_inflight: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Its concurrency limit; default: the backend's ``max_inflight_per_server``."""


class DrainQuery(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str
    wait: bool = True
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 600.0


class Drained(msgspec.Struct):
    url: str
    drained: bool
    """True once the server runs nothing (it has left); false while requests still run on it
    (``wait=false``, or past ``timeout_s``): it keeps draining."""
    inflight: int


def _view(server: ServerState, state: ServerStateName) -> ServerView:
    return ServerView(
        server.url,
        server.role,
        state,
        server.inflight,
        server.limit,
        server.requests,
        server.ejections,
    )


def pool_view(pool: Pool) -> PoolView:
    servers = [_view(s, "serving" if s.healthy else "ejected") for s in pool.servers]
    servers += [_view(s, "draining") for s in pool.leaving()]
    return PoolView(pool.backend, pool.role, servers, pool_signals(pool))


def _client(request: Request[Any, Any, Any], backend: str, role: str) -> tuple[VllmClient, Pool]:
    registry: ModelRegistry = request.app.state.registry
    client = registry.generation.get(backend)
    if not isinstance(client, VllmClient):
        raise ApiError(404, f"No vLLM backend {backend!r}.", code="backend_not_found")
    pool = client.pool(role) if role in ROLES else None
    if pool is None:
        raise ApiError(404, f"Backend {backend!r} has no {role!r} pool.", code="pool_not_found")
    return client, pool


async def _keep(
    request: Request[Any, Any, Any],
    pool: Pool,
    server: ServerState,
    state: MemberState,
    max_inflight: int | None = None,
) -> None:
    """Write the change this gateway just applied to the membership store. One the store
    cannot take is a 503: an added server leaves again (nothing changed: retry the call), a
    drained one drains on this gateway only (drain it again once the store is back)."""
    membership: PoolMembership | None = request.app.state.membership
    if membership is None:
        return
    try:
        await membership.record(pool.backend, pool.role, server.url, state, max_inflight)
    except Exception as exc:
        if state == "added":
            pool.drain(server)
        raise ApiError(
            503,
            f"The pool membership store did not take the change ({type(exc).__name__}): "
            + (
                f"{server.url} was not added; retry once the store is back."
                if state == "added"
                else f"{server.url} drains on this gateway only; drain it again once the "
                "store is back."
            ),
            code="membership_not_saved",
            type="server_error",
        ) from None


def _json(value: msgspec.Struct) -> Response[bytes]:
    return Response(msgspec.json.encode(value), media_type="application/json")


@get(
    "/admin/backends",
    opt={"auth": "admin"},
    operation_class=documented(
        RouteDoc(
            summary="List the vLLM pools",
            tag="Admin",
            description="Each pool's servers (serving, ejected, draining) and the signals that "
            "say it is short: queue depth, queue time, time to first token, KV-cache usage. "
            "Needs the admin role.",
            answers=(Answer(200, PoolList, "Every pool of every vLLM backend."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def list_pools(request: Request[Any, Any, Any]) -> Response[bytes]:
    require_admin(request)
    registry: ModelRegistry = request.app.state.registry
    views = [
        pool_view(pool)
        for client in registry.generation.values()
        if isinstance(client, VllmClient)
        for pool in client.pools
    ]
    return _json(PoolList(views))


@post(
    "/admin/backends/{backend:str}/{role:str}/servers",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Add a server to a pool",
            tag="Admin",
            description="A running vLLM server joins the pool (`both`, `prefill` or `decode`) "
            "of a backend at once; it is health-checked first and joins ejected if the check "
            "fails (the next passing check admits it). Not written to the config: kept in "
            "the pool membership store, so a restart and every gateway sharing it keep it. "
            "Needs the admin role.",
            body=AddServer,
            answers=(Answer(200, ServerView, "The server is in the pool."),),
            errors=(*ADMIN_ERRORS, 404, 409, 503),
        )
    ),
)
async def add_server(
    request: Request[Any, Any, Any], backend: FromPath[str], role: FromPath[str]
) -> Response[bytes]:
    require_admin(request)
    client, pool = _client(request, backend, role)
    req = msgspec.convert(parse_body(await request.body()), AddServer)
    parts = urlsplit(req.url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ApiError(400, "`url` must be http(s)://host:port.", param="url")
    try:
        server = await client.add_server(pool.role, req.url, req.max_inflight)
    except ValueError as exc:
        raise ApiError(409, str(exc), code="server_conflict") from None
    await _keep(request, pool, server, "added", req.max_inflight)
    return _json(_view(server, "serving" if server.healthy else "ejected"))


@delete(
    "/admin/backends/{backend:str}/{role:str}/servers",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Drain a server out of a pool",
            tag="Admin",
            description="The server takes no new request; those it runs finish there, then it "
            "leaves. With `wait` (the default) the answer comes once it has left or after "
            "`timeout_s`; asked again while it drains, it waits again. The last server of the "
            "answering pool cannot leave (409). Kept in the pool membership store like an "
            "added server. "
            "Needs the admin role.",
            query=(
                Field("url", {"type": "string"}, "The server's URL.", required=True),
                Field("wait", {"type": "boolean"}, "Answer once it has left (default true)."),
                Field(
                    "timeout_s",
                    {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
                    "Longest wait (default 600).",
                ),
            ),
            answers=(Answer(200, Drained, "The server drains (or has left)."),),
            errors=(*ADMIN_ERRORS, 404, 409, 503),
        )
    ),
)
async def drain_server(
    request: Request[Any, Any, Any], backend: FromPath[str], role: FromPath[str]
) -> Response[bytes]:
    require_admin(request)
    client, pool = _client(request, backend, role)
    query = msgspec.convert(dict(request.query_params), DrainQuery, strict=False)
    try:
        _, server = client.drain_server(pool.role, query.url)
    except LookupError as exc:
        raise ApiError(404, str(exc), code="server_not_found") from None
    except ValueError as exc:
        raise ApiError(409, str(exc), code="last_server") from None
    await _keep(request, pool, server, "drained")
    drained = not server.inflight
    if query.wait:
        drained = await pool.wait_drained(server, query.timeout_s)
    return _json(Drained(server.url, drained, server.inflight))


ROUTES = [list_pools, add_server, drain_server]
