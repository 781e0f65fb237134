"""The Workers-AI route: read the body, hand it to the Workers-AI serving object."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.params import FromPath

from server.caching import directives_from
from server.openai.routing import context, parse_body, respond
from server.workers_ai.protocol import truthy
from server.workers_ai.serving import WorkersAIServing


def workers_ai(request: Request[Any, Any, Any]) -> WorkersAIServing:
    svc: WorkersAIServing = request.app.state.workers_ai
    return svc


@post("/client/v4/accounts/{account_id:str}/ai/run/{model:path}", opt={"auth": "key"})
async def run_model(
    request: Request[Any, Any, Any], account_id: FromPath[str], model: FromPath[str]
) -> Response[Any]:
    svc = workers_ai(request)
    ctx = context(request)
    body = parse_body(await request.body())
    reply = await svc.run(
        model.lstrip("/"),
        body,
        ctx,
        queue_request=truthy(request.query_params.get("queueRequest")),
        directives=directives_from(request.headers),
    )
    return respond(reply, ctx)


ROUTES = [run_model]
