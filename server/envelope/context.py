"""The request's context as a route reads it: the envelope's record of the request (its id,
principal and usage), the ticket of its tenant in the fair queue, whether it may act as an
admin."""

from __future__ import annotations

from typing import Any

from litestar import Request

from foundation.request import RequestContext
from server.envelope.queue_tickets import PRIORITY_HEADER, Tickets
from server.envelope.record import RequestRecord, record_of
from server.errors import ApiError
from server.identity.auth import TokenAuth


def principal_tenant(request: Request[Any, Any, Any]) -> str:
    """The tenant owning stored objects (files, batches): the authenticated token's."""
    return record(request).principal.tenant


def record(request: Request[Any, Any, Any]) -> RequestRecord:
    """The tenancy middleware's record of this request (every API route has one)."""
    found = record_of(request.scope)
    if found is None:
        raise RuntimeError(f"{request.url.path} is public: it has no principal")
    return found


def context(request: Request[Any, Any, Any]) -> RequestContext:
    """The request's context: its id, tenant and usage are the tenancy record's."""
    rec = record(request)
    tickets: Tickets = request.app.state.queue_tickets
    tenant = rec.principal.tenant
    return RequestContext(
        request_id=rec.request_id,
        session_affinity=request.headers.get("x-session-affinity"),
        tenant=tenant,
        token_id=rec.principal.token_id,
        models=rec.principal.models,
        usage=rec.usage,
        queue=tickets.ticket(tenant, priority=request.headers.get(PRIORITY_HEADER)),
    )


def require_admin(request: Request[Any, Any, Any]) -> None:
    """The request's principal has the admin role: the one the tenancy middleware resolved,
    or on a route that authenticates itself (``auth="self"``: the dashboard, whose login
    cookie a router middleware turns into a bearer token), the same ``TokenAuth``'s."""
    record = record_of(request.scope)
    if record is not None:
        principal = record.principal
    else:
        auth: TokenAuth = request.app.state.auth
        principal = auth.authenticate(request.headers, key_required=True)
    if not principal.admin:
        raise ApiError(403, "This route needs a token with the admin role.")
