"""The operator dashboard at ``/dashboard``: server-rendered pages over JSON endpoints.

Every page is a Jinja template rendered from the same dict its JSON endpoint
(``/dashboard/api/<page>``) returns; ``static/dashboard.js`` re-fetches the page's data
section and its charts' columns every few seconds. Every page and endpoint needs the admin
token (``server.admin.api_router.require_admin``): sent as ``Authorization: Bearer``, or kept by the
browser in an HttpOnly, SameSite=Strict cookie set by the login form.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlencode

import httpx
import msgspec
from litestar import Request, Response, Router, get, post
from litestar.datastructures import Cookie
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.types import ASGIApp, Receive, Scope, Send

from foundation.package_files import package_file
from server.admin.api_router import PurgeRequest, purge_caches
from server.dashboard import figures as fig
from server.dashboard import keys as dashboard_keys
from server.dashboard.keys import keys_page
from server.dashboard.series import WINDOWS, CounterSeries
from server.envelope.context import require_admin
from server.envelope.middleware import Envelope
from server.errors import ApiError
from server.http.respond import parse_body

PAGES = ("overview", "tenants", "keys", "backends", "cache", "batches", "requests")
COOKIE = "semcache_admin"
REFRESH_S = 5
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'"
)
LEDGER_NOTE = "the usage ledger is not available on this gateway yet"
LOG_NOTE = "the request log is not available on this gateway yet"


@dataclass
class DashboardState:
    """What the dashboard keeps in the process: the counters' series and recent purges."""

    series: CounterSeries
    purges: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=20))


def _cookie_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"cookie":
            morsel = SimpleCookie(value.decode("latin-1")).get(COOKIE)
            if morsel is not None and morsel.value:
                return morsel.value
    return None


def cookie_as_bearer(app: ASGIApp) -> ASGIApp:
    """The login cookie, when no ``Authorization`` header came, read as the bearer token."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        headers = list(scope.get("headers", ()))
        if not any(name == b"authorization" for name, _ in headers):
            token = _cookie_token(headers)
            if token is not None:
                headers.append((b"authorization", f"Bearer {token}".encode("latin-1")))
                scope = {**scope, "headers": headers}  # type: ignore[assignment]
        await app(scope, receive, send)

    return middleware


def _state(request: Request[Any, Any, Any]) -> DashboardState:
    dashboard: DashboardState = request.app.state.dashboard
    return dashboard


async def _call(request: Request[Any, Any, Any], path: str, query: dict[str, str]) -> Any:
    """A GET to another route of this gateway, in process, with the same credentials;
    ``None`` when it answers anything but 200 (a route not built yet: 404)."""
    headers = {"authorization": request.headers.get("authorization", "")}
    transport = httpx.ASGITransport(app=request.app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        url = f"{path}?{urlencode({k: v for k, v in query.items() if v})}"
        answer = await client.get(url, headers=headers)
    return answer.json() if answer.status_code == 200 else None


# -- the data of each page (the JSON endpoints and the templates read the same) -----------


async def overview(request: Request[Any, Any, Any]) -> dict[str, Any]:
    samples = fig.read_samples(request.app.state.metrics.registry)
    totals = fig.overview_totals(samples)
    lookups = totals["exact_hits"] + totals["misses"]
    hist = fig.histogram_state(samples)
    status = {k.removeprefix("status_"): v for k, v in totals.items() if k.startswith("status_")}
    return {
        "totals": totals,
        "status": dict(sorted(status.items())),
        "exact_hit_rate": totals["exact_hits"] / lookups if lookups else None,
        "semantic_hit_rate": totals["semantic_hits"] / lookups if lookups else None,
        "latency_p50_s": fig.quantile(hist["latency"], 0.5),
        "latency_p99_s": fig.quantile(hist["latency"], 0.99),
        "ttft_p50_s": fig.quantile(hist["ttft"], 0.5),
        "ttft_p99_s": fig.quantile(hist["ttft"], 0.99),
        "content": fig.content_findings(samples),
        "windows": list(WINDOWS),
    }


async def backends(request: Request[Any, Any, Any]) -> dict[str, Any]:
    samples = fig.read_samples(request.app.state.metrics.registry)
    partitions = []
    semantic = request.app.state.core.semantic
    cache = semantic.loaded if semantic is not None else None
    if cache is not None:
        for key in cache.index.keys():
            part = cache.index.get(key)
            partitions.append(
                {
                    "scope": key.scope,
                    "model": key.model_revision,
                    "task": key.task,
                    "entries": len(part) if part is not None else 0,
                }
            )
    return {
        "servers": fig.backend_servers(samples),
        "pools": fig.backend_pools(samples),
        "kv": fig.kv_placement(samples),
        "queue": fig.fair_queue(samples),
        "semantic_loaded": cache is not None,
        "partitions": partitions,
    }


async def cache(request: Request[Any, Any, Any]) -> dict[str, Any]:
    samples = fig.read_samples(request.app.state.metrics.registry)
    exact = request.app.state.core.cache
    tiers: list[dict[str, Any]] = []
    if exact is not None:
        if exact.memory is not None:
            tiers.append(
                {"tier": "memory", "entries": len(exact.memory), "bytes": exact.memory.bytes_used}
            )
        for store in exact.lower:
            volume = getattr(store, "volume", None)
            tiers.append({"tier": store.tier, "entries": None, "bytes": volume})
    stored = fig.by_label(samples, "semcache_exact_stored_bytes_total", "tier")
    served = fig.by_label(samples, "semcache_exact_served_bytes_total", "tier")
    for row in tiers:
        row["stored_bytes"] = stored.get(row["tier"], 0.0)
        row["served_bytes"] = served.get(row["tier"], 0.0)
    return {
        "enabled": exact is not None,
        "tiers": tiers,
        "purges_by_kind": fig.by_label(samples, "semcache_exact_purges_total", "kind"),
        "recent_purges": list(reversed(_state(request).purges)),
        "stores": fig.total(samples, "semcache_exact_stores_total"),
    }


async def batches(request: Request[Any, Any, Any]) -> dict[str, Any]:
    samples = fig.read_samples(request.app.state.metrics.registry)
    recent = await request.app.state.batches.store.recent(50)
    now = time.time()
    unfinished = [b for b in recent if not b.finished]
    counts = [b.request_counts for b in unfinished]
    shown = request.query_params.get("batch")
    chosen = next((b for b in recent if b.id == shown), recent[0] if recent else None)
    queue = request.app.state.batch_system.queue
    depth = await queue.depth() if queue is not None else None
    return {
        "queue": msgspec.to_builtins(depth) if depth is not None else None,
        "running": fig.total(samples, "semcache_batch_running"),
        "items": fig.by_label(samples, "semcache_batch_items_total", "outcome"),
        "retries": fig.total(samples, "semcache_batch_retries_total"),
        "preemptions": fig.total(samples, "semcache_batch_preemptions_total"),
        "queued_items": sum(c.total - c.completed - c.failed for c in counts),
        "oldest_unfinished_age_s": now - min(b.created_at for b in unfinished)
        if unfinished
        else None,
        "batches": [_batch_row(b) for b in recent],
        "batch": _batch_row(chosen) if chosen is not None else None,
    }


def _batch_row(batch: Any) -> dict[str, Any]:
    row = msgspec.to_builtins(batch)
    return {
        k: row.get(k)
        for k in (
            "id",
            "tenant",
            "endpoint",
            "model",
            "status",
            "created_at",
            "completed_at",
            "request_counts",
            "output_file_id",
            "error_file_id",
        )
    }


async def tenants(request: Request[Any, Any, Any]) -> dict[str, Any]:
    query = {k: request.query_params.get(k, "") for k in ("start", "end")}
    usage = await _call(request, "/v1/usage", {**query, "group_by": "tenant,model"})
    samples = fig.read_samples(request.app.state.metrics.registry)
    tokens = fig.by_label(samples, "semcache_tokens_total", "model")
    saved = fig.by_label(samples, "semcache_exact_tokens_saved_total", "model")
    usd = fig.by_label(samples, "semcache_exact_usd_saved_total", "model")
    models = [
        {
            "model": m,
            "tokens": tokens.get(m, 0.0),
            "tokens_saved": saved.get(m, 0.0),
            "usd_saved": usd.get(m, 0.0),
        }
        for m in sorted(set(tokens) | set(saved))
    ]
    return {
        "ledger": usage["data"] if usage is not None else None,
        "note": None if usage is not None else LEDGER_NOTE,
        "models": models,
        "limits": await _limits(request),
        "query": query,
    }


async def _limits(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    """Each configured token's limits and what remains of them."""
    tenancy: Envelope = request.app.state.envelope
    if tenancy.limiter is None:
        return []
    out = []
    for principal in tenancy.auth.principals:
        status = await tenancy.limiter.status(
            principal.token_id, principal.tenant, principal.limits
        )
        out.append(msgspec.to_builtins(status))
    return out


async def requests(request: Request[Any, Any, Any]) -> dict[str, Any]:
    query = {k: request.query_params.get(k, "") for k in ("tenant", "status", "model")}
    logs = await _call(request, "/admin/logs", {**query, "limit": "100"})
    samples = fig.read_samples(request.app.state.metrics.registry)
    counts = fig.labelled_rows(samples, fig.REQUESTS, ("route", "status"))
    return {
        "log": logs["data"] if logs is not None else None,
        "note": None if logs is not None else LOG_NOTE,
        "by_route": sorted(counts, key=lambda r: (str(r["route"]), str(r["status"]))),
        "query": query,
    }


DATA = {
    "overview": overview,
    "tenants": tenants,
    "keys": keys_page,
    "backends": backends,
    "cache": cache,
    "batches": batches,
    "requests": requests,
}


# -- routes --------------------------------------------------------------------------------


def _refused(request: Request[Any, Any, Any], err: ApiError) -> Template:
    return Template(
        "login.html",
        context={"message": err.message, "next": request.url.path},
        status_code=err.status,
        headers={"content-security-policy": CSP, "cache-control": "no-store"},
    )


@get("/", opt={"auth": "public"})
async def index() -> Redirect:
    return Redirect("/dashboard/overview")


@get("/login", opt={"auth": "public"})
async def login_form() -> Template:
    return Template("login.html", context={"message": None, "next": "/dashboard/overview"})


@post("/login", status_code=303, opt={"auth": "public"})
async def login(request: Request[Any, Any, Any]) -> Redirect:
    """Keep the token in a cookie; the page it leads to checks it (a wrong one: 403 page)."""
    form = await request.form()
    token = str(form.get("token", "")).strip()
    target = str(form.get("next", ""))
    if not target.startswith("/dashboard/") or target.startswith("/dashboard/login"):
        target = "/dashboard/overview"
    cookie = Cookie(
        key=COOKIE,
        value=token,
        path="/dashboard",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return Redirect(target, status_code=303, cookies=[cookie])


@get("/{page:str}")
async def page(request: Request[Any, Any, Any]) -> Template:
    page = str(request.path_params["page"])
    try:
        require_admin(request)
    except ApiError as err:
        return _refused(request, err)
    if page not in DATA:
        raise ApiError(404, f"No dashboard page `{page}`.")
    data = await DATA[page](request)
    partial = request.query_params.get("partial") == "1"
    return Template(
        f"{page}.html",
        context={
            "page": page,
            "pages": PAGES,
            "data": data,
            "partial": partial,
            "refresh_s": REFRESH_S,
        },
        headers={"content-security-policy": CSP, "cache-control": "no-store"},
    )


@get("/api/{page:str}")
async def page_data(request: Request[Any, Any, Any]) -> dict[str, Any]:
    require_admin(request)
    page = str(request.path_params["page"])
    if page not in DATA:
        raise ApiError(404, f"No dashboard endpoint `{page}`.")
    return await DATA[page](request)


@get("/api/series/{window:str}")
async def series(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The overview's charts: one column per figure, one row per step of the window."""
    require_admin(request)
    window = str(request.path_params["window"])
    if window not in WINDOWS:
        raise ApiError(400, f"`window` is one of {', '.join(WINDOWS)}.", param="window")
    return {
        "window": window,
        "step_s": WINDOWS[window].step_s,
        **_state(request).series.chart(window),
    }


@post("/api/purge", status_code=200)
async def purge(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The cache page's purge form (the admin API's purge; a custom header keeps out forms
    posted from other sites)."""
    require_admin(request)
    if request.headers.get("x-semcache-dashboard") != "1":
        raise ApiError(403, "Purges from the dashboard need `x-semcache-dashboard: 1`.")
    req = msgspec.convert(parse_body(await request.body()), PurgeRequest)
    if req.kind != "all" and not req.target:
        raise ApiError(400, f"Purge by {req.kind} needs a `target`.", param="target")
    result = msgspec.to_builtins(await purge_caches(request.app.state.core, req))
    _state(request).purges.append({**result, "time": time.time()})
    return Response(msgspec.json.encode(result), media_type="application/json")


def dashboard_router() -> Router:
    """``/dashboard``: the pages, their JSON, the purge form, and the static files."""
    static = create_static_files_router(
        path="/static",
        directories=[package_file("server", "dashboard", "static")],
        opt={"auth": "public"},
    )
    return Router(
        path="/dashboard",
        route_handlers=[
            index,
            login_form,
            login,
            page,
            page_data,
            series,
            purge,
            *dashboard_keys.ROUTES,
            static,
        ],
        middleware=[cookie_as_bearer],
        opt={"auth": "self"},
        include_in_schema=False,
    )
