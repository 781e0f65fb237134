"""A backend's stream relayed to the client as it arrives, a stored answer replayed as a
stream, and the error event that ends a broken one."""

from __future__ import annotations

from collections.abc import AsyncIterator

from backends.protocol import BackendError, UpstreamStream
from foundation import tracing as spans
from foundation.sse import SSEReader, error_event
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


async def relay(call: GenerationCall, upstream: UpstreamStream) -> AsyncIterator[bytes]:
    """Relay chunks as they arrive (no cache); a broken upstream ends the stream with an
    error event. With a usage note (``output_limit``) the events are framed again, the
    note in their usage."""
    reader = SSEReader()
    note = call.usage_note
    form = stream_format(call.route) if note is not None else None
    first = True
    span = spans.start_span("stream")
    try:
        async for chunk in upstream.chunks():
            if first:
                call.observe_ttft()
                first = False
            if form is None:
                reader.feed(chunk)
                yield chunk
            elif items := form.read(reader, chunk):
                yield b"".join(form.frame(noted_item(item, note)) for item in items)
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
