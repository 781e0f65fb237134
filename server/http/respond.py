"""What every thin route shares: its JSON body parsed, and a ``Reply`` sent as a Litestar
response (``no-store`` unless it says otherwise; a 304 for a GET whose ETag matches)."""

from __future__ import annotations

from typing import Any

import orjson
from litestar import Response
from litestar.background_tasks import BackgroundTask

from foundation.request import RequestContext
from server.errors import ApiError
from server.http.conditional import NO_STORE, not_modified
from server.http.internals import EncodedResponse, RelayStream
from server.http.reply import Reply, aclose_stream


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode a JSON request body; anything but a JSON object is a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(
            400,
            "We could not parse the JSON body of your request. "
            "(HINT: This likely means you aren't using your HTTP library correctly.)",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def reply_headers(reply: Reply, request_id: str | None) -> dict[str, str]:
    """The headers ``reply`` is sent with: ``no-store`` when it says nothing of caching,
    and the request's id."""
    headers = dict(reply.headers)
    headers.setdefault("cache-control", NO_STORE)
    if request_id is not None:
        headers["x-request-id"] = request_id
    return headers


def respond(
    reply: Reply, ctx: RequestContext | None = None, *, if_none_match: str | None = None
) -> Response[Any]:
    """``reply`` as a response; ``if_none_match`` (GET routes): a 304 when it names the
    answer's ETag. An answer that says nothing of caching is ``no-store``."""
    headers = reply_headers(reply, ctx.request_id if ctx is not None else None)
    if if_none_match is not None and reply.status == 200 and reply.stream is None:
        unchanged = not_modified(headers, if_none_match)
        if unchanged is not None:
            if ctx is not None:
                unchanged["x-request-id"] = ctx.request_id
            return Response(b"", status_code=304, headers=unchanged)
    if reply.stream is not None:
        return RelayStream(
            reply.stream,
            status_code=reply.status,
            media_type=reply.media_type,
            headers=headers,
            # When the client leaves, Litestar stops sending and leaves the generator suspended
            # at its `yield`: its `finally` (which aborts the backend and keeps a partial
            # answer out of the cache) would otherwise run only at garbage collection.
            background=BackgroundTask(aclose_stream, reply.stream),
        )
    return EncodedResponse(
        reply.body, status_code=reply.status, media_type=reply.media_type, headers=headers
    )
