"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from server.errors import ANTHROPIC, ApiError, ErrorFormat


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, kw_only=True):
    """Anthropic's error body: the shape of every error on ``/v1/messages``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_status(err: ApiError) -> int:
    """Anthropic's status for an error: the gateway's backend queue being full is its 529
    (overloaded: the service's capacity, not the client's rate limit)."""
    return 529 if err.code == "backend_overloaded" else err.status


def anthropic_error_body(err: ApiError) -> bytes:
    status = anthropic_status(err)
    if status in _TYPES:
        kind = _TYPES[status]
    else:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    detail = AnthropicErrorDetail(kind, err.said_by(ANTHROPIC))
    return msgspec.json.encode(AnthropicError(error=detail))


def _render(err: ApiError) -> tuple[int, bytes]:
    return anthropic_status(err), anthropic_error_body(err)


ANTHROPIC_ERRORS: Final = ErrorFormat(AnthropicError, _render)
