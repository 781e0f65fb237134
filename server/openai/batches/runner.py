"""One line of an OpenAI batch, run by the batch workers through the ``/v1`` serving path
(caches included), answered as a line of the output file."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import orjson

from backends.interfaces import BackendError
from foundation.request import RequestContext
from server.batch.results import ItemOutcome
from server.errors import ApiError, from_backend, from_validation, openai_error_body
from server.http.reply import Reply, aclose_stream
from server.openai.batches.protocol import InputLine
from server.serving.cache_headers import CacheDirectives

RETRYABLE = (408, 429, 502, 503, 504)

Call = Callable[[dict[str, Any], RequestContext, CacheDirectives], Awaitable[Reply]]
"""A family's ``create`` (or ``embeddings``): a line's body, its context, no cache headers."""

StopReason = Callable[[str, str], Awaitable[str | None]]
"""``(tenant, batch_id)`` → ``"cancelled"`` or ``"expired"`` when the batch's remaining lines
must not run, else None."""


def line_id(batch_id: str, line: int) -> str:
    return "batch_req_" + hashlib.blake2b(f"{batch_id}:{line}".encode(), digest_size=12).hexdigest()


class OpenAIItemRunner:
    """Runs the queued lines of OpenAI batches (the ``ItemRunner`` of their payloads)."""

    def __init__(self, calls: Mapping[str, Call], stop_reason: StopReason) -> None:
        """``calls``: the serving call of each endpoint a line may name (its ``url``)."""
        self.calls = dict(calls)
        self.stop_reason = stop_reason

    async def run_item(self, model: str, body: dict[str, Any], ctx: RequestContext) -> ItemOutcome:
        try:
            line = msgspec.convert(body, InputLine)
        except msgspec.ValidationError as exc:  # not queued by the Batch API: answer, never retry
            err = from_validation(exc)
            return ItemOutcome(success=False, errors=[{"code": 400, "message": err.message}])
        out: dict[str, Any] = {
            "id": line_id(line.batch_id, line.line),
            "custom_id": line.custom_id,
            "response": None,
            "error": None,
        }
        reason = await self.stop_reason(ctx.tenant or "anonymous", line.batch_id)
        if reason is not None:
            out["error"] = {"code": f"batch_{reason}", "message": f"The batch was {reason}."}
            return ItemOutcome(success=False, response=out)
        request = {k: v for k, v in line.body.items() if k not in ("stream", "stream_options")}
        request["model"] = model
        status, answer = await self._call(line.url, request, ctx)
        out["response"] = {"status_code": status, "request_id": ctx.request_id, "body": answer}
        usage = answer.get("usage") if status == 200 and isinstance(answer, dict) else None
        counts = (
            {k: v for k, v in usage.items() if type(v) is int} if isinstance(usage, dict) else None
        )
        return ItemOutcome(
            success=status == 200,
            usage=counts,
            retryable=status in RETRYABLE,
            response=out,
        )

    async def _call(self, url: str, body: dict[str, Any], ctx: RequestContext) -> tuple[int, Any]:
        call = self.calls[url]
        try:
            reply: Reply = await call(body, ctx, CacheDirectives())
        except msgspec.ValidationError as exc:
            return error_answer(from_validation(exc))
        except BackendError as exc:
            return error_answer(from_backend(exc))
        except ApiError as exc:
            return error_answer(exc)
        if reply.stream is not None:  # never asked for; closed unread
            await aclose_stream(reply.stream)
            return error_answer(
                ApiError(502, "The model streamed its answer.", code="backend_error")
            )
        return reply.status, orjson.loads(reply.body) if reply.body else None


def error_answer(err: ApiError) -> tuple[int, Any]:
    return err.status, orjson.loads(openai_error_body(err))
