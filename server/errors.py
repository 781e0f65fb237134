"""The gateway's errors and the one exception handler that answers them.

An ``ApiError`` says what went wrong; the surface that owns the request's path renders it in
its API's own shape (its ``ErrorFormat``, ``server/surface.py``). OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` is the gateway's own: the one of every
surface that names no other, and of paths no surface owns. No handler ever returns a stack
trace.
"""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import orjson
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError

from backends.interfaces import BackendError
from foundation.redis_client import UNREACHABLE_ERRORS
from foundation.redis_replication import NotReplicated

log = logging.getLogger("semcache.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error to report to the client in the API's own format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
        wording: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "api_error")
        self.retry_after_s = retry_after_s
        self.headers = headers or {}
        self.wording = wording or {}
        """The message in another surface's own words, by surface (``ANTHROPIC``,
        ``WORKERS_AI``); ``message`` is OpenAI's, and any surface's without its own."""

    def said_by(self, surface: str) -> str:
        """The message as ``surface`` words it."""
        return self.wording.get(surface, self.message)


ANTHROPIC: Final = "anthropic"
WORKERS_AI: Final = "workers_ai"

ERROR_CODE_KEY = "semcache.error_code"
"""Where the code of the error a request was answered with sits in its ``state``."""

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`")


def from_validation(exc: msgspec.ValidationError) -> ApiError:
    """Turn a msgspec message ("Expected `int` - at `$.n`") into a 400 naming the field."""
    text = str(exc)
    m = _PATH.search(text)
    param = m.group("path") if m else None
    reason = _PATH.sub("", text)
    missing = _MISSING.match(text)
    if missing is not None:  # the field is inside the object the path names
        field = missing.group("field")
        param = f"{param}.{field}" if param else field
        return ApiError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    message = f"Invalid value for '{param}': {reason}" if param else f"Invalid request: {reason}"
    return ApiError(400, message, param=param or None, code="invalid_value")


def relayed_error(status: int, body: bytes) -> ApiError:
    """A backend's error answer (OpenAI's shape, as vLLM answers) as an ApiError with the same
    status and message: for a surface that answers in its own format."""
    message = f"The model failed with status {status}."
    code: str | None = None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        err: dict[str, Any] = inner if isinstance(inner, dict) else doc
        if isinstance(err.get("message"), str):
            message = err["message"]
        if isinstance(err.get("code"), str):
            code = err["code"]
    return ApiError(status, message, code=code)


def from_backend(exc: BackendError) -> ApiError:
    status = {"timeout": 504, "overloaded": 429, "unavailable": 503}.get(exc.kind, 502)
    code = {504: "backend_timeout", 429: "backend_overloaded", 503: "backend_unavailable"}
    return ApiError(
        status, exc.message, code=code.get(status, "backend_error"), retry_after_s=exc.retry_after_s
    )


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None
    """The gateway's codes are strings; an error relayed from vLLM carries its HTTP status."""


class OpenAIError(msgspec.Struct):
    """OpenAI's error body: the shape of every error on ``/v1`` (and the admin API)."""

    error: OpenAIErrorDetail


def openai_error_body(err: ApiError) -> bytes:
    return msgspec.json.encode(
        OpenAIError(OpenAIErrorDetail(err.message, err.type, err.param, err.code))
    )


@dataclass(frozen=True)
class ErrorFormat:
    """How a surface answers an error: its body's type (for the OpenAPI document) and the
    function that renders an ``ApiError`` as (status, body)."""

    model: type
    render: Callable[[ApiError], tuple[int, bytes]]


def _openai(err: ApiError) -> tuple[int, bytes]:
    return err.status, openai_error_body(err)


OPENAI_ERRORS: Final = ErrorFormat(OpenAIError, _openai)
"""The gateway's own error format."""


def error_response(err: ApiError, errors: ErrorFormat = OPENAI_ERRORS) -> Response[bytes]:
    """The response of ``err`` in ``errors``' shape; never stored by any cache."""
    status, body = errors.render(err)
    headers = {**err.headers, "cache-control": "no-store"}  # no cache may keep an error
    if err.retry_after_s is not None:
        headers["retry-after"] = str(err.retry_after_s)
    return Response(body, status_code=status, media_type=MediaType.JSON, headers=headers)


def _http_exception(exc: HTTPException) -> ApiError:
    status = exc.status_code
    if status == 413:
        return ApiError(413, "Request body is too large.", code="request_too_large")
    if status == 404:
        return ApiError(404, "Unknown route.", code="unknown_url")
    if status == 405:
        return ApiError(405, "Method not allowed.", code="method_not_allowed")
    detail = exc.detail if isinstance(exc.detail, str) else "Bad request."
    return ApiError(status, detail)


def disk_full(exc: BaseException) -> bool:
    """A write refused for lack of space (``ENOSPC``, a quota, SQLite's ``SQLITE_FULL``),
    raised directly or while handling another error."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, sqlite3.OperationalError) and (
            getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e)
        ):
            return True
    return False


def api_error(request: Request[Any, Any, Any], exc: Exception) -> ApiError:
    """What any exception a route raised means to its client: API errors as they are,
    Litestar's HTTP errors, a full disk or store, bugs (500, no trace)."""
    if isinstance(exc, ApiError):
        err = exc
    elif isinstance(exc, msgspec.ValidationError):
        err = from_validation(exc)
    elif isinstance(exc, BackendError):
        err = from_backend(exc)
    elif isinstance(exc, HTTPException):
        err = _http_exception(exc)
    elif disk_full(exc):  # what needs the disk (a batch, a file) is refused, plainly
        log.warning("%s refused: the data dir's disk is full (%s)", request.url.path, exc)
        err = ApiError(
            507,
            "The gateway's disk is full: the request could not be stored. Retry later.",
            code="insufficient_storage",
        )
    elif isinstance(exc, RedisOutOfMemoryError):
        log.warning("%s refused: Redis is at its maxmemory (%s)", request.url.path, exc)
        err = ApiError(
            507,
            "The gateway's shared store is full: the request could not be stored. Retry later.",
            code="insufficient_storage",
        )
    elif isinstance(exc, NotReplicated):
        log.warning("%s refused: %s", request.url.path, exc)
        err = ApiError(
            503,
            "The gateway's shared store could not copy the request to a replica in time; "
            "it was not accepted. Retry later.",
            code="not_replicated",
            retry_after_s=1,
        )
    elif isinstance(exc, UNREACHABLE_ERRORS):  # the shared store cannot serve it
        log.warning("%s refused: Redis is unreachable (%s)", request.url.path, exc)
        err = ApiError(
            503,
            "The gateway's shared store is unreachable. Retry later.",
            code="store_unavailable",
            retry_after_s=1,
        )
    else:
        log.exception("unhandled error on %s", request.url.path)
        err = ApiError(500, "Internal error in the gateway.", code="internal_error")
    request.state[ERROR_CODE_KEY] = err.code or err.type  # for the request log
    return err


ExceptionHandler = Callable[[Request[Any, Any, Any], Exception], Response[bytes]]


def exception_handler(format_of: Callable[[str], ErrorFormat]) -> ExceptionHandler:
    """The one handler of the app: every error in the format of the surface that owns the
    request's path (``format_of``)."""

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
        return error_response(api_error(request, exc), format_of(request.url.path))

    return handle
