"""``/v1/batches``: create, retrieve, list, cancel."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.params import FromPath

from server.openai.batches.serving import BatchesServing
from server.openai.routing import parse_body, principal_tenant, respond


def batches(request: Request[Any, Any, Any]) -> BatchesServing:
    svc: BatchesServing = request.app.state.batches
    return svc


@post("/v1/batches", opt={"auth": "key"})
async def create_batch(request: Request[Any, Any, Any]) -> Response[Any]:
    tenant = principal_tenant(request)
    body = parse_body(await request.body())
    return respond(await batches(request).create(tenant, body))


@get("/v1/batches", opt={"auth": "key"})
async def list_batches(request: Request[Any, Any, Any]) -> Response[Any]:
    q = request.query_params
    reply = await batches(request).list_batches(
        principal_tenant(request), after=q.get("after"), limit=q.get("limit")
    )
    return respond(reply)


@get("/v1/batches/{batch_id:str}", opt={"auth": "key"})
async def retrieve_batch(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
    return respond(await batches(request).retrieve(principal_tenant(request), batch_id))


@post("/v1/batches/{batch_id:str}/cancel", status_code=200, opt={"auth": "key"})
async def cancel_batch(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
    return respond(await batches(request).cancel(principal_tenant(request), batch_id))


ROUTES = [create_batch, list_batches, retrieve_batch, cancel_batch]
