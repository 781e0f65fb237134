"""One request as the tenancy layer sees it: who sent it, where it went, what it used."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from foundation.request import RequestContext, RequestUsage
from server.identity.auth import Principal

RECORD_KEY = "semcache.record"
"""Where the record sits in the ASGI scope's ``state`` while the request runs."""


class RequestRecord(msgspec.Struct, kw_only=True):
    request_id: str
    time: float
    """Wall-clock start (seconds since the epoch)."""
    started: float
    """``perf_counter`` at the start, for the durations."""
    principal: Principal
    route: str
    """The route's path template, e.g. ``/v1/chat/completions``."""
    usage: RequestUsage = msgspec.field(default_factory=RequestUsage)
    background: bool = False
    status: int = 0
    ttft_s: float | None = None
    """Time to the first byte of the answer's body."""
    latency_s: float | None = None
    completed: bool = False
    """The whole answer was sent (False: the client left, or the stream broke)."""
    bodies: dict[str, Any] | None = None
    """The request and response bodies, when the route's rule says ``log_bodies``."""
    trace_id: str | None = None
    """The request's OpenTelemetry trace id, when tracing is on."""


def record_of(scope: Mapping[str, Any]) -> RequestRecord | None:
    """The record of the request ``scope`` belongs to; ``None`` on a public route."""
    state = scope.get("state")
    return state.get(RECORD_KEY) if state is not None else None


def log_line(record: RequestRecord) -> dict[str, Any]:
    """The request log's JSON object for ``record`` (never a token, never a body)."""
    return {
        "request_id": record.request_id,
        "time": round(record.time, 3),
        "tenant": record.principal.tenant,
        "token": record.principal.token_id,
        "route": record.route,
        "status": record.status,
        "completed": record.completed,
        "latency_ms": _ms(record.latency_s),
        "ttft_ms": _ms(record.ttft_s),
        "trace_id": record.trace_id,
        **_usage_fields(record.usage),
        **(record.bodies or {}),
    }


def item_line(ctx: RequestContext, success: bool, now: float) -> dict[str, Any]:
    """The request log's JSON object for a batch item this gateway finished."""
    return {
        "request_id": ctx.request_id,
        "time": round(now, 3),
        "tenant": ctx.tenant,
        "token": None,
        "route": "batch",
        "status": 200 if success else 500,
        "completed": success,
        "latency_ms": None,
        "ttft_ms": None,
        **_usage_fields(ctx.usage),
    }


def _usage_fields(usage: RequestUsage) -> dict[str, Any]:
    return {
        "model": usage.model,
        "cache": usage.cache,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "saved_tokens": usage.saved_prompt_tokens + usage.saved_completion_tokens,
        "servers": usage.servers,
        "pd_hop": usage.pd_hop,
        "error_code": usage.error_code,
        **({"findings": usage.findings} if usage.findings else {}),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
