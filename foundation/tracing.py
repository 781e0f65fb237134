"""Request traces (OpenTelemetry): the tracer a request runs under, and spans that cost one
context-variable read when tracing is off.

The app factory builds a :class:`Tracing` from its config (``server/telemetry.py``) and the
request's entry points (the tenancy middleware, the early hits, the batch workers) make it
the request's tracer with :func:`activate`; every layer below opens spans with :func:`span`
and passes the trace on to vLLM with :func:`inject`, without being handed a tracer. With
tracing off nothing is activated: :func:`span` hands back one shared no-op context and
:func:`inject` returns at once. In a trace the sampler dropped, :func:`span` does the same
after one more read (the current span is not recording), while :func:`inject` still passes
the unsampled ``traceparent`` on, so vLLM drops its spans too. No global tracer provider is
ever set.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar, Token
from typing import Final

from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
    Span,
    SpanKind,
    Tracer,
    TracerProvider,
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

_OFF: Final[nullcontext[None]] = nullcontext()
_PROPAGATOR: Final = TraceContextTextMapPropagator()
_CURRENT: ContextVar[Tracing | None] = ContextVar("semcache_tracing", default=None)


class Tracing:
    """One app's tracer over the provider the app factory built (and shuts down)."""

    def __init__(self, provider: TracerProvider, name: str = "semcache") -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer(name)

    def close(self) -> None:
        """Export the spans still queued and stop the provider's exporters (blocks)."""
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def root(
        self,
        name: str,
        headers: Mapping[str, str] | None = None,
        *,
        kind: SpanKind = SpanKind.SERVER,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[Link] = (),
    ) -> AbstractContextManager[Span]:
        """The span a request's trace starts with: a child of the client's ``traceparent``
        when ``headers`` carry one, else the root of a new trace (never a child of whatever
        span is current). ``links``: spans it follows from in other traces (a batch item's
        submit, :func:`link_to`)."""
        parent: Context = _PROPAGATOR.extract(headers or {})
        return self.tracer.start_as_current_span(
            name, context=parent, kind=kind, attributes=attributes, links=links
        )


def activate(tracing: Tracing) -> Token[Tracing | None]:
    """Make ``tracing`` the tracer of the current request (context); undo with :func:`reset`."""
    return _CURRENT.set(tracing)


def reset(token: Token[Tracing | None]) -> None:
    _CURRENT.reset(token)


def current() -> Tracing | None:
    """The current request's tracing; ``None`` when tracing is off."""
    return _CURRENT.get()


def recording() -> bool:
    """Whether spans opened now are kept: tracing on and the current trace sampled."""
    return _CURRENT.get() is not None and get_current_span().is_recording()


def span(
    name: str, attributes: Mapping[str, AttributeValue] | None = None
) -> AbstractContextManager[Span | None]:
    """A child span of the current one, made current while the block runs; ``None`` (a
    shared no-op context) when tracing is off or the trace is not sampled."""
    tracing = _CURRENT.get()
    if tracing is None or not get_current_span().is_recording():
        return _OFF  # off, or a trace the sampler dropped: its children are dropped too
    return tracing.tracer.start_as_current_span(name, attributes=attributes)


def annotate(attributes: Mapping[str, AttributeValue]) -> None:
    """Set attributes on the current span (e.g. the id of the batch a request queued)."""
    if _CURRENT.get() is not None:
        get_current_span().set_attributes(attributes)


def start_span(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Span | None:
    """A child span of the current one that the caller ends, never made current (a stream
    relayed by a generator, which must not change the context of the task reading it);
    ``None`` when tracing is off."""
    tracing = _CURRENT.get()
    if tracing is None or not get_current_span().is_recording():
        return None
    return tracing.tracer.start_span(name, attributes=attributes)


def record_span(
    name: str,
    started: float,
    ended: float,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> None:
    """A span measured after the fact, ``started`` and ``ended`` read from
    ``time.perf_counter()`` (e.g. the KV hand-off: from the prefill answer to decode's first
    event)."""
    tracing = _CURRENT.get()
    if tracing is None or not get_current_span().is_recording():
        return
    offset = time.time_ns() - int(time.perf_counter() * 1e9)
    done = tracing.tracer.start_span(
        name, start_time=offset + int(started * 1e9), attributes=attributes
    )
    done.end(end_time=offset + int(ended * 1e9))


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` to an outgoing request's headers."""
    if _CURRENT.get() is not None:
        _PROPAGATOR.inject(headers)


def current_traceparent() -> str | None:
    """The current span's W3C ``traceparent``, for work done later in a trace of its own to
    link back to (a batch's submit, stored with its job); ``None`` when tracing is off or
    the span is not sampled."""
    if _CURRENT.get() is None or not get_current_span().is_recording():
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def link_to(
    traceparent: str | None, attributes: Mapping[str, AttributeValue] | None = None
) -> list[Link]:
    """A span link to the span a stored ``traceparent`` names; none when there is none (or it
    does not parse)."""
    if not traceparent:
        return []
    linked = get_current_span(_PROPAGATOR.extract({"traceparent": traceparent}))
    context = linked.get_span_context()
    return [Link(context, attributes)] if context.is_valid else []


def current_trace_id() -> str | None:
    """The current request's trace id (32 hex digits); ``None`` when tracing is off."""
    if _CURRENT.get() is None:
        return None
    return trace_id_of(get_current_span())


def trace_id_of(current_span: Span | None) -> str | None:
    """The 32-hex-digit trace id of a span (``None`` without a valid one)."""
    if current_span is None:
        return None
    context = current_span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None
