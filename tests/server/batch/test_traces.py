"""A batch in traces (``server/batch/traces.py``): what the job keeps of its submit, and the
link each item's root span makes from it; spans go to the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from foundation import tracing as spans
from server.batch.queue.base import WorkItem
from server.batch.traces import item_span, submit_traced
from server.telemetry import TracingSettings, build_tracing


class Recorded:
    """The part of a queue ``submit_traced`` calls: it keeps what it was handed."""

    def __init__(self) -> None:
        self.trace_contexts: list[str | None] = []

    async def submit(
        self,
        job_id: str,
        tenant: str,
        model: str,
        payloads: Sequence[bytes],
        *,
        trace_context: str | None = None,
    ) -> None:
        self.trace_contexts.append(trace_context)


def item(trace_context: str | None) -> WorkItem:
    return WorkItem(
        job_id="j",
        index=3,
        tenant="t",
        model="m",
        payload=b"{}",
        attempts=1,
        receipt="r",
        trace_context=trace_context,
    )


def traced(exporter: InMemorySpanExporter, ratio: float = 1.0) -> spans.Tracing:
    tracing = build_tracing(TracingSettings(sample_ratio=ratio), {}, exporter=exporter)
    assert tracing is not None
    return tracing


async def test_the_job_keeps_the_submit_spans_traceparent() -> None:
    exporter = InMemorySpanExporter()
    tracing = traced(exporter)
    queue = Recorded()
    token = spans.activate(tracing)
    try:
        with tracing.root("POST /batches"):
            await submit_traced(queue, "j", "t", "m", [b"a", b"b"])  # type: ignore[arg-type]
    finally:
        spans.reset(token)
    (submit,) = [s for s in exporter.get_finished_spans() if s.name == "batch.submit"]
    assert submit.context is not None and submit.attributes is not None
    assert dict(submit.attributes) == {"semcache.batch_id": "j", "semcache.batch_items": 2}
    trace_hex = format(submit.context.trace_id, "032x")
    span_hex = format(submit.context.span_id, "016x")
    (kept,) = queue.trace_contexts
    assert kept is not None
    version, trace, span, flags = kept.split("-")
    assert (version, trace, span) == ("00", trace_hex, span_hex)
    assert int(flags, 16) & 1  # sampled


@pytest.mark.parametrize("sampled", [None, 0.0], ids=["off", "unsampled"])
async def test_no_trace_context_is_kept_off_or_unsampled(sampled: float | None) -> None:
    queue = Recorded()
    if sampled is None:
        await submit_traced(queue, "j", "t", "m", [b"a"])  # type: ignore[arg-type]
    else:
        exporter = InMemorySpanExporter()
        tracing = traced(exporter, sampled)
        token = spans.activate(tracing)
        try:
            with tracing.root("POST /batches"):
                await submit_traced(queue, "j", "t", "m", [b"a"])  # type: ignore[arg-type]
        finally:
            spans.reset(token)
        assert exporter.get_finished_spans() == ()
    assert queue.trace_contexts == [None]


def test_an_items_root_is_a_new_trace_linked_to_the_submit() -> None:
    exporter = InMemorySpanExporter()
    tracing = traced(exporter)
    linked = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with tracing.root("something current"), item_span(tracing, item(linked)):
        pass
    root, outer = exporter.get_finished_spans()
    assert root.name == "batch item" and root.parent is None
    assert root.context is not None and outer.context is not None
    assert root.context.trace_id != outer.context.trace_id  # never a child of the current span
    (link,) = root.links
    assert (format(link.context.trace_id, "032x"), format(link.context.span_id, "016x")) == (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "00f067aa0ba902b7",
    )
    assert link.attributes is not None
    assert dict(link.attributes) == {"semcache.batch_id": "j", "semcache.batch_index": 3}


@pytest.mark.parametrize("stored", [None, "", "not-a-traceparent"])
def test_an_item_without_a_usable_trace_context_has_no_link(stored: str | None) -> None:
    exporter = InMemorySpanExporter()
    tracing = traced(exporter)
    with item_span(tracing, item(stored)):
        pass
    (root,) = exporter.get_finished_spans()
    assert root.name == "batch item" and tuple(root.links) == ()
    assert root.attributes is not None and root.attributes["semcache.batch_index"] == 3
