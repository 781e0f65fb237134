"""A backend's stream relayed to the client as it arrives, a stored answer replayed as a
stream, and the error event that ends a broken one."""

from __future__ import annotations

from collections.abc import AsyncIterator

from backends.interfaces import BackendError, UpstreamStream
from foundation import tracing as spans
from foundation.sse import DONE, SSEReader, error_event, event
from server.errors import ApiError
from server.guard.stream import StreamGuard, stream_guard
from server.serving.call import GenerationCall
from server.serving.output_limit import noted_item
from server.serving.stream_format import StreamFormat, stream_format


def broken_stream_event(message: str | None) -> bytes:
    """The event that ends a stream the backend broke (``message``) or cut short."""
    text = (
        f"The backend failed mid-answer: {message}"
        if message
        else "The backend ended the answer early."
    )
    return error_event(text, code="backend_stream_broken")


def unsupported_stream() -> ApiError:
    """A streamed Responses API answer under answer rules (its named events are not read)."""
    return ApiError(
        400,
        "Streamed answers of the Responses API cannot be inspected by this gateway's content "
        "rules; send `stream: false`.",
        param="stream",
        code="unsupported_value",
    )


def guard_event(err: ApiError) -> bytes:
    """The error event that ends a stream the content rules blocked mid-answer."""
    return error_event(err.message, type=err.type, code=err.code)


async def answer_stream(call: GenerationCall) -> StreamGuard | None:
    """The inspection of the call's streamed answer, where a rule applies to it."""
    inspection = call.inspection
    if inspection is None or not inspection.answers:
        return None
    return await stream_guard(inspection.guard, inspection.policy, inspection.rule, call.ctx)


async def relay(
    call: GenerationCall, upstream: UpstreamStream, inspected: StreamGuard | None = None
) -> AsyncIterator[bytes]:
    """Relay chunks as they arrive (no cache); a broken upstream ends the stream with an
    error event. ``inspected``: the events are read and sent again as the rules leave them
    (a block ends the stream with an error event). With a usage note (``output_limit``) the
    events are framed again, the note in their usage."""
    reader = SSEReader()
    limit = call.output_limit
    form = stream_format(call.route) if limit.sent is not None and inspected is None else None
    first = True
    span = spans.start_span("stream")
    try:
        async for chunk in upstream.chunks():
            if first:
                call.observe_ttft()
                first = False
            if inspected is not None:
                out = []
                try:
                    for item in reader.feed(chunk):
                        if item == DONE:
                            await inspected.finish()
                        out.append(event(noted_item(inspected.feed(item), limit)))
                except ApiError as err:
                    yield b"".join(out) + guard_event(err)
                    return
                yield b"".join(out)
            elif form is None:
                reader.feed(chunk)
                yield chunk
            elif items := form.read(reader, chunk):
                yield b"".join(form.frame(noted_item(item, limit)) for item in items)
    except BackendError as exc:
        call.backend_failed(exc.kind)
        yield broken_stream_event(exc.message)
        return
    finally:
        await upstream.aclose()
        if span is not None:
            span.set_attribute("semcache.complete", reader.done)
            span.end()
    if not reader.done:
        call.backend_failed("broken")
        yield broken_stream_event(None)
        return
    call.observe_latency(stream=True)
    call.count_usage(reader.usage())


async def replayed(items: list[bytes], form: StreamFormat) -> AsyncIterator[bytes]:
    """A stored answer's items as events, then what ends the stream (``[DONE]``)."""
    for item in items:
        yield form.frame(item)
    if form.end:
        yield form.end
