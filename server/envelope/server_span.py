"""A request's trace: its server span (a child of the client's ``traceparent``), opened where
the request enters the gateway (the tenancy middleware, or the early hits before routing),
and what the span says about the request once it has ended."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

from opentelemetry.trace import Span, StatusCode

from foundation import tracing as spans
from foundation.tracing import Tracing
from server.envelope.record import RequestRecord, record_of

TRACE_HEADERS: Final = (b"traceparent", b"tracestate")


def trace_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The W3C trace-context headers of an ASGI scope's raw header list."""
    out: dict[str, str] = {}
    for name, value in raw:
        low = name.lower()
        if low in TRACE_HEADERS:
            out[low.decode()] = value.decode("latin-1")
    return out


def describe(root: Span, record: RequestRecord | None) -> None:
    """Set what the request's record says on its server span."""
    if record is None or not root.is_recording():
        return
    usage = record.usage
    attributes: dict[str, Any] = {
        "http.response.status_code": record.status,
        "semcache.request_id": record.request_id,
        "semcache.tenant": record.principal.tenant,
        "semcache.cache": usage.cache,
        "semcache.completed": record.completed,
    }
    if usage.model is not None:
        attributes["gen_ai.request.model"] = usage.model
    if usage.servers:
        attributes["semcache.servers"] = list(usage.servers)
    if usage.error_code is not None:
        attributes["error.type"] = usage.error_code
    root.set_attributes(attributes)
    if record.status >= 500:
        root.set_status(StatusCode.ERROR)


async def run_traced(
    tracing: Tracing, scope: Any, route: str, serve: Callable[[], Awaitable[None]]
) -> None:
    """Run ``serve`` (the request) under a new server span of ``tracing``."""
    token = spans.activate(tracing)
    try:
        method = scope.get("method", "GET")
        with tracing.root(
            f"{method} {route}",
            trace_headers(scope["headers"]),
            attributes={"http.request.method": method, "http.route": route},
        ) as root:
            try:
                await serve()
            finally:
                describe(root, record_of(scope))
    finally:
        spans.reset(token)
