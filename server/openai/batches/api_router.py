"""``/v1/batches``: create, retrieve, list, cancel."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.openapi.spec import Link
from litestar.params import FromPath

from server.apidoc.operation import (
    CLIENT_ERRORS,
    SERVER_ERROR,
    Answer,
    Field,
    Public,
    RouteDoc,
    documented,
)
from server.apidoc.request_headers import STRING
from server.envelope.context import principal_tenant, record
from server.http.respond import parse_body, respond
from server.openai.batches.protocol import BatchCreate, BatchObject
from server.openai.batches.serving import BatchesServing
from server.openai.protocol import ListPage

BATCH_ID = {"batch_id": "$response.body#/id"}


def batches(request: Request[Any, Any, Any]) -> BatchesServing:
    svc: BatchesServing = request.app.state.batches
    return svc


@post(
    "/v1/batches",
    opt={"auth": "key"},
    operation_class=documented(
        RouteDoc(
            summary="Create a batch",
            tag="OpenAI batches",
            body=BatchCreate,
            answers=(
                Answer(
                    200,
                    Public(BatchObject),
                    "The batch, validating or failed.",
                    links={
                        "retrieve": Link(operation_id="retrieve_batch", parameters=BATCH_ID),
                        "cancel": Link(operation_id="cancel_batch", parameters=BATCH_ID),
                    },
                ),
            ),
            errors=(*CLIENT_ERRORS, 404, *SERVER_ERROR),
        )
    ),
)
async def create_batch(request: Request[Any, Any, Any]) -> Response[Any]:
    principal = record(request).principal
    body = parse_body(await request.body())
    return respond(await batches(request).create(principal.tenant, body, principal.models))


@get(
    "/v1/batches",
    opt={"auth": "key"},
    operation_class=documented(
        RouteDoc(
            summary="List batches",
            tag="OpenAI batches",
            query=(
                Field("after", STRING, "A batch id: the page after it."),
                Field("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "Page size."),
            ),
            answers=(Answer(200, ListPage, "One page of batches, newest first."),),
            errors=(400, 401, 429, *SERVER_ERROR),
        )
    ),
)
async def list_batches(request: Request[Any, Any, Any]) -> Response[Any]:
    q = request.query_params
    reply = await batches(request).list_batches(
        principal_tenant(request), after=q.get("after"), limit=q.get("limit")
    )
    return respond(reply)


@get(
    "/v1/batches/{batch_id:str}",
    opt={"auth": "key"},
    operation_class=documented(
        RouteDoc(
            summary="Retrieve a batch",
            tag="OpenAI batches",
            answers=(Answer(200, Public(BatchObject), "The batch."),),
            errors=(401, 404, 429, *SERVER_ERROR),
        )
    ),
)
async def retrieve_batch(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
    return respond(await batches(request).retrieve(principal_tenant(request), batch_id))


@post(
    "/v1/batches/{batch_id:str}/cancel",
    opt={"auth": "key"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Cancel a batch",
            tag="OpenAI batches",
            answers=(Answer(200, Public(BatchObject), "The batch, cancelling or cancelled."),),
            errors=(401, 404, 409, 429, *SERVER_ERROR),
        )
    ),
)
async def cancel_batch(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
    return respond(await batches(request).cancel(principal_tenant(request), batch_id))


ROUTES = [create_batch, list_batches, retrieve_batch, cancel_batch]
