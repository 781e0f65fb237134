"""A batch in traces: its submit is a span whose trace context the job keeps, and each item
a trace of its own whose root span links back to that span."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

from opentelemetry.trace import Span, SpanKind

from foundation import tracing as spans
from foundation.tracing import Tracing
from server.batch.queue.base import BatchQueue, WorkItem


async def submit_traced(
    queue: BatchQueue, job_id: str, tenant: str, model: str, payloads: Sequence[bytes]
) -> None:
    """Queue a job under a ``batch.submit`` span; the job keeps that span's ``traceparent``
    (none when tracing is off or the request is not sampled) for its items to link to."""
    attributes: dict[str, str | int] = {
        "semcache.batch_id": job_id,
        "semcache.batch_items": len(payloads),
    }
    with spans.span("batch.submit", attributes):
        trace_context = spans.current_traceparent()
        await queue.submit(job_id, tenant, model, payloads, trace_context=trace_context)
    spans.annotate({"semcache.batch_id": job_id})  # the request's server span names it too


def item_span(tracing: Tracing, item: WorkItem) -> AbstractContextManager[Span]:
    """The root span of a batch item's own trace (kind consumer), linked to its batch's
    ``batch.submit`` span when the job kept one; a job queued without one has no link."""
    named: dict[str, str | int] = {
        "semcache.batch_id": item.job_id,
        "semcache.batch_index": item.index,
    }
    return tracing.root(
        "batch item",
        kind=SpanKind.CONSUMER,
        attributes={**named, "gen_ai.request.model": item.model, "semcache.attempt": item.attempts},
        links=spans.link_to(item.trace_context, named),
    )
