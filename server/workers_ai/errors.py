"""Cloudflare's error envelope: ``{"result": null, "success": false, "errors": [...]}``."""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from server.errors import WORKERS_AI, ApiError, ErrorFormat


class WorkersAIErrorEntry(msgspec.Struct):
    code: int
    """The HTTP status times ten (Cloudflare's codes are four digits)."""
    message: str


class WorkersAIError(msgspec.Struct, kw_only=True):
    """Cloudflare's envelope of a failed request: the shape of every error on ``/client/v4``."""

    result: None = None
    success: Literal[False] = False
    errors: list[WorkersAIErrorEntry]
    messages: list[str] = msgspec.field(default_factory=list)


def workers_ai_error_body(err: ApiError) -> bytes:
    return msgspec.json.encode(
        WorkersAIError(errors=[WorkersAIErrorEntry(err.status * 10, err.said_by(WORKERS_AI))])
    )


def _render(err: ApiError) -> tuple[int, bytes]:
    return err.status, workers_ai_error_body(err)


WORKERS_AI_ERRORS: Final = ErrorFormat(WorkersAIError, _render)
