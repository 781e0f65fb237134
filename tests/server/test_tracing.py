"""Tracing on the request path, fast: the span tree of a miss through a P/D pair, of a hit,
the client's ``traceparent``, the ``traceparent`` sent on each hop, the request log's trace id,
batch items as traces of their own linked to their batch's submit.

The prefill and decode servers are local HTTP servers answering like vLLM
(``harness.fake_vllm``); spans go to the SDK's in-memory exporter, except in the
slow semantic test: ``semcache serve`` exporting to a real OTLP receiver. The same through
real vLLM too: ``test_tracing_vllm.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import pytest
from aiohttp import web
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from backends.config import VllmBackendConfig, VllmServer
from harness.fake_vllm import FakeServer, sse
from harness.gateway import GatewayProcess, GatewayThread, write_config_toml
from harness.otlp_receiver import OtlpReceiver, ReceivedSpan
from server.config import GatewayConfig, ModelEntry
from server.limits.settings import LimitSettings
from server.telemetry import TracingSettings
from tests.support.waiting import wait_until_async

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e"}
LONG = "The cat reads a book near the window. " * 10
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SPAN_KIND_SERVER = OtlpSpan.SpanKind.SPAN_KIND_SERVER


class Hops:
    """A fake prefill and a fake decode server; each request's ``traceparent`` is kept."""

    def __init__(self) -> None:
        self.traceparents: dict[str, list[str | None]] = {"prefill": [], "decode": []}
        self.prefill = FakeServer(self._handler("prefill"))
        self.decode = FakeServer(self._handler("decode"))

    def _handler(self, role: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            if request.path != "/v1/chat/completions":
                return web.Response(status=200)  # /health
            body = orjson.loads(await request.read())
            self.traceparents[role].append(request.headers.get("traceparent"))
            if role == "prefill":
                answer = {"choices": [], "kv_transfer_params": PARAMS}
                return web.json_response(answer)
            if body.get("stream"):
                hi = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
                return await sse(request, hi, b"data: [DONE]\n\n")
            message = {"role": "assistant", "content": "Hi"}
            return web.json_response(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "model": "m",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 90, "completion_tokens": 1, "total_tokens": 91},
                }
            )

        return handle


@pytest.fixture
async def hops() -> AsyncIterator[Hops]:
    found = Hops()
    await found.prefill.start()
    await found.decode.start()
    yield found
    await found.prefill.stop()
    await found.decode.stop()


def config(tmp_path: Path, hops: Hops) -> GatewayConfig:
    servers = [
        VllmServer(url=hops.prefill.url, role="prefill"),
        VllmServer(url=hops.decode.url, role="decode"),
    ]
    backend = VllmBackendConfig(
        name="pd",
        served_model="m",
        revision="test",
        servers=servers,
        prefill_threshold_tokens=8,
        health_interval_s=3600,
        cache_salt_secret="s",
    )
    return GatewayConfig(
        data_dir=str(tmp_path), models=[ModelEntry(id="chat", backend="pd")], backends=[backend]
    )


def chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": LONG}]
    return {"model": "chat", "messages": messages, "temperature": 0, **extra}


def trace_of(spans: list[ReadableSpan], trace_id: int) -> dict[str, list[ReadableSpan]]:
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        if span.context is not None and span.context.trace_id == trace_id:
            by_name.setdefault(span.name, []).append(span)
    return by_name


def root_of(spans: list[ReadableSpan]) -> ReadableSpan:
    (root,) = [s for s in spans if s.kind is SpanKind.SERVER]
    return root


def parents(traceparents: list[str | None]) -> list[str | None]:
    """The traceparents without their flags (sampled, and the SDK's random-id flag)."""
    return [t.rsplit("-", 1)[0] if t else None for t in traceparents]


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


def parent_id(span: ReadableSpan) -> str | None:
    return format(span.parent.span_id, "016x") if span.parent is not None else None


@contextmanager
def gateway(
    tmp_path: Path,
    hops: Hops,
    exporter: InMemorySpanExporter | None,
    tracing: TracingSettings | None = None,
) -> Iterator[GatewayThread]:
    """The gateway in a thread of its own (the fake servers answer on the test's loop)."""
    settings = config(tmp_path, hops)
    if tracing is not None:
        settings = msgspec.structs.replace(settings, tracing=tracing)
    running = GatewayThread(settings, span_exporter=exporter).start()
    try:
        yield running
    finally:
        running.stop()


async def post(
    url: str, body: dict[str, Any], timeout_s: float = 30, **headers: str
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        return await client.post("/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_miss_is_one_trace_through_placement_prefill_and_decode(
    tmp_path: Path, hops: Hops, stream: bool
) -> None:
    exporter = InMemorySpanExporter()
    with gateway(tmp_path, hops, exporter) as gw:
        r = await post(gw.url, chat(stream=stream))
        assert r.status_code == 200
    spans = list(exporter.get_finished_spans())
    root = root_of(spans)
    assert root.name == "POST /v1/chat/completions"
    assert root.attributes is not None and root.attributes["semcache.cache"] == "miss"
    assert root.context is not None
    trace = trace_of(spans, root.context.trace_id)
    assert len(spans) == sum(len(v) for v in trace.values())  # one trace, nothing else
    expected = {"auth", "cache.exact", "cache.tier", "placement", "prefill", "decode"}
    if stream:
        expected |= {"stream", "kv.handoff"}
    assert expected <= set(trace)
    for name in expected:  # every span hangs under the server span
        for span in trace[name]:
            assert span.parent is not None
    by_id = {span_id(s): s for s in spans}
    for span in spans:
        if span is not root:
            # parent links intact: each parent is a span of the trace, up to the root
            assert parent_id(span) in by_id
    (placement,) = trace["placement"]
    assert placement.attributes is not None
    assert placement.attributes["semcache.server"] == hops.decode.url
    assert placement.attributes["semcache.prefill"] is True
    assert placement.attributes["semcache.placement.reason"] in {
        "session",
        "prefix",
        "least_loaded",
    }
    tiers = {s.attributes["semcache.tier"] for s in trace["cache.tier"] if s.attributes}
    assert tiers == {"memory", "disk"}
    # each hop's traceparent names its own span: vLLM's spans join the trace under it
    (prefill,) = trace["prefill"]
    (decode,) = trace["decode"]
    trace_hex = format(root.context.trace_id, "032x")
    assert parents(hops.traceparents["prefill"]) == [f"00-{trace_hex}-{span_id(prefill)}"]
    assert parents(hops.traceparents["decode"]) == [f"00-{trace_hex}-{span_id(decode)}"]


async def test_auth_and_limits_are_spans_of_the_request(tmp_path: Path, hops: Hops) -> None:
    exporter = InMemorySpanExporter()
    settings = msgspec.structs.replace(
        config(tmp_path, hops), limits=LimitSettings(requests_per_minute=1000)
    )
    running = GatewayThread(settings, span_exporter=exporter).start()
    try:
        r = await post(running.url, chat())
        assert r.status_code == 200
    finally:
        running.stop()
    spans = list(exporter.get_finished_spans())
    root = root_of(spans)
    assert root.context is not None
    trace = trace_of(spans, root.context.trace_id)
    (limits,) = trace["limits"]
    assert parent_id(limits) == span_id(root)
    # the token is checked by the early hits before routing, then by the route's middleware
    assert [parent_id(auth) for auth in trace["auth"]] == [span_id(root)] * 2


SEMANTIC_POLICY = """
version = 1
[models."chat".routes.chat.semantic]
enabled = true
threshold = 0.8
min_threshold = 0.8
"""


QUICK_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
"""The gateway's batch span processor exports every 200 ms instead of 5 s."""


def received_trace(receiver: OtlpReceiver, trace_id: str) -> dict[str, list[ReceivedSpan]]:
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in receiver.trace(trace_id):
        by_name.setdefault(span.name, []).append(span)
    return by_name


@pytest.mark.slow  # the real MiniLM encoder is loaded
async def test_the_semantic_lookup_is_a_span_and_a_semantic_hit_has_no_backend_span(
    tmp_path: Path, hops: Hops
) -> None:
    """``semcache serve`` exporting to a real OTLP receiver."""
    policy = tmp_path / "policy.toml"
    policy.write_text(SEMANTIC_POLICY)
    asked = ["What is the capital of France?", "What's the capital of France?"]
    with OtlpReceiver() as receiver:
        settings = msgspec.structs.replace(
            config(tmp_path, hops),
            policy=str(policy),
            tracing=TracingSettings(endpoint=receiver.endpoint),
        )
        toml = write_config_toml(settings, tmp_path / "gateway.toml")

        def servers() -> list[ReceivedSpan]:
            return receiver.matching(lambda s: s.kind == SPAN_KIND_SERVER)

        running = GatewayProcess(toml, env=QUICK_EXPORT).start()
        try:
            for text in asked:
                body = {"model": "chat", "messages": [{"role": "user", "content": text}]}
                # The first semantic request loads the encoder.
                r = await post(running.url, {**body, "temperature": 0}, timeout_s=300)
                assert r.status_code == 200
            await wait_until_async(lambda: len(servers()) >= len(asked), timeout_s=60)
        finally:
            running.stop()
        # A root ends after its children and the requests ran one after the other: the
        # receiver holds the roots in the order they were asked.
        roots = servers()
    assert [r.attributes["semcache.cache"] for r in roots if r.attributes] == ["miss", "semantic"]
    looked: list[Any] = []
    for root in roots:
        trace = received_trace(receiver, root.trace_id)
        (encode,) = trace["semantic.encode"]
        (lookup,) = trace["cache.semantic"]
        assert encode.parent_id and lookup.attributes is not None
        looked.append(lookup.attributes["semcache.hit"])
    assert looked == [False, True]
    hit = received_trace(receiver, roots[1].trace_id)
    assert not {"placement", "prefill", "decode", "stream"} & set(hit)
    (lookup,) = hit["cache.semantic"]
    assert lookup.attributes is not None and float(lookup.attributes["semcache.similarity"]) >= 0.8
    assert len(hops.traceparents["decode"]) == 1  # only the miss reached a backend


async def logged(gw: GatewayThread, lines: int) -> list[dict[str, Any]]:
    """The request log once it holds ``lines`` lines: a stream's line is written as it
    ends on the server, which may come after the client read its last byte."""
    recent = gw.app.state.envelope.request_log.recent
    await wait_until_async(lambda: len(recent) >= lines)
    return list(recent)


async def test_a_hit_has_no_backend_span_early_or_routed(tmp_path: Path, hops: Hops) -> None:
    exporter = InMemorySpanExporter()
    with gateway(tmp_path, hops, exporter) as gw:
        for _ in range(3):  # a miss, a hit through the route, then an early hit
            r = await post(gw.url, chat())
            assert r.status_code == 200
        log = await logged(gw, 3)
    spans = list(exporter.get_finished_spans())
    roots = sorted((s for s in spans if s.kind is SpanKind.SERVER), key=lambda s: s.start_time)
    assert [r.attributes["semcache.cache"] for r in roots if r.attributes] == [
        "miss",
        "exact",
        "exact",
    ]
    assert len({r.context.trace_id for r in roots if r.context}) == 3
    for root in roots[1:]:
        assert root.context is not None
        trace = trace_of(spans, root.context.trace_id)
        assert not {"placement", "prefill", "decode", "stream"} & set(trace)
        (exact,) = trace["cache.exact"]
        assert exact.attributes is not None
        assert (exact.attributes["semcache.status"], exact.attributes["semcache.tier"]) == (
            "HIT",
            "memory",
        )
    assert len(hops.traceparents["decode"]) == 1
    # the request log line carries each request's trace id
    assert [line["trace_id"] for line in log] == [
        format(r.context.trace_id, "032x") for r in roots if r.context
    ]


async def test_the_clients_traceparent_is_the_parent(tmp_path: Path, hops: Hops) -> None:
    exporter = InMemorySpanExporter()
    with gateway(tmp_path, hops, exporter) as gw:
        r = await post(gw.url, chat(), traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
        assert r.status_code == 200
    root = root_of(list(exporter.get_finished_spans()))
    assert root.context is not None and root.parent is not None
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert parent_id(root) == CLIENT_SPAN
    assert hops.traceparents["decode"][0] is not None
    assert hops.traceparents["decode"][0].startswith(f"00-{CLIENT_TRACE}-")


async def test_tracing_off_sends_no_traceparent_and_logs_no_trace_id(
    tmp_path: Path, hops: Hops
) -> None:
    with gateway(tmp_path, hops, None) as gw:
        assert gw.app.state.tracing is None
        r = await post(gw.url, chat(stream=True))
        assert r.status_code == 200
        log = await logged(gw, 1)
    assert hops.traceparents == {"prefill": [None], "decode": [None]}
    assert [line["trace_id"] for line in log] == [None]


async def submit_workers_ai(client: httpx.AsyncClient, contents: list[str]) -> str:
    items = [{"messages": [{"role": "user", "content": c}]} for c in contents]
    r = await client.post(
        "/client/v4/accounts/a/ai/run/chat?queueRequest=true", json={"requests": items}
    )
    assert r.status_code == 200, r.text
    return str(r.json()["result"]["request_id"])


async def submit_openai(client: httpx.AsyncClient, contents: list[str]) -> str:
    lines = [
        orjson.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "chat", "messages": [{"role": "user", "content": c}]},
            }
        )
        for i, c in enumerate(contents)
    ]
    upload = await client.post(
        "/v1/files",
        files={"file": ("in.jsonl", b"\n".join(lines) + b"\n")},
        data={"purpose": "batch"},
    )
    assert upload.status_code == 200, upload.text
    r = await client.post(
        "/v1/batches",
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize("submit", [submit_workers_ai, submit_openai], ids=["workers-ai", "openai"])
async def test_batch_items_are_traces_of_their_own_linked_to_the_submit(
    tmp_path: Path, hops: Hops, submit: Any
) -> None:
    exporter = InMemorySpanExporter()
    with gateway(tmp_path, hops, exporter) as gw:
        async with httpx.AsyncClient(
            base_url=gw.url, timeout=30, headers={"authorization": "Bearer any"}
        ) as client:
            batch_id = await submit(client, [f"{LONG} {i}" for i in range(2)])

        def item_roots() -> list[ReadableSpan]:
            return [s for s in exporter.get_finished_spans() if s.name == "batch item"]

        await wait_until_async(lambda: len(item_roots()) == 2)
    spans = list(exporter.get_finished_spans())
    (queued,) = [s for s in spans if s.name == "batch.submit"]
    assert queued.attributes is not None and queued.attributes["semcache.batch_id"] == batch_id
    assert queued.context is not None
    (submit_root,) = [
        s
        for s in spans
        if s.kind is SpanKind.SERVER and s.context and s.context.trace_id == queued.context.trace_id
    ]
    assert submit_root.attributes is not None
    assert submit_root.attributes["semcache.batch_id"] == batch_id
    roots = item_roots()
    assert sorted(r.attributes["semcache.batch_index"] for r in roots if r.attributes) == [0, 1]
    assert {r.attributes["semcache.batch_id"] for r in roots if r.attributes} == {batch_id}
    traces = {r.context.trace_id for r in roots if r.context}
    assert len(traces | {queued.context.trace_id}) == 3  # the submit's trace and one per item
    for root in roots:
        assert root.parent is None and root.context is not None and root.attributes is not None
        (link,) = root.links
        assert (link.context.trace_id, link.context.span_id) == (
            queued.context.trace_id,
            queued.context.span_id,
        )
        assert link.attributes is not None
        assert dict(link.attributes) == {
            "semcache.batch_id": batch_id,
            "semcache.batch_index": root.attributes["semcache.batch_index"],
        }
        assert "decode" in trace_of(spans, root.context.trace_id)


async def test_an_unsampled_trace_keeps_no_span_and_tells_vllm_so(
    tmp_path: Path, hops: Hops
) -> None:
    exporter = InMemorySpanExporter()
    with gateway(tmp_path, hops, exporter, TracingSettings(sample_ratio=0.0)) as gw:
        r = await post(gw.url, chat(stream=True))
        assert r.status_code == 200
        log = await logged(gw, 1)
    assert list(exporter.get_finished_spans()) == []
    for role in ("prefill", "decode"):
        (traceparent,) = hops.traceparents[role]
        assert traceparent is not None
        assert int(traceparent.rsplit("-", 1)[1], 16) & 1 == 0  # not sampled
        assert traceparent.split("-")[1] == log[0]["trace_id"]
