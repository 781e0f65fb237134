"""One trace per request through ``semcache serve``, real vLLM prefill/decode and a real OTLP
receiver (``harness/otlp_receiver.py``): the gateway's spans and vLLM's own ``llm_request``
spans of the prefill and the decode server in one trace, parent links intact; a hit with no
backend span; a client's ``traceparent`` as the trace's parent; the trace id in the request log;
a batch's items as traces of their own, each root span linked to the batch's submit span.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.otlp_receiver import OtlpReceiver, ReceivedSpan
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUICK_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
"""Batch span processors export every 200 ms instead of 5 s (the gateway's and vLLM's)."""
SPANS_WAIT_S = 60.0
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SENTENCE = "The cat reads a book near the window. A bird visits the old tree every day. "


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as found:
        yield found


@pytest.fixture(scope="module")
async def pd_pair(data_dir: Path, receiver: OtlpReceiver) -> AsyncIterator[dict[str, VllmProcess]]:
    """A prefill (core 0) and a decode server (core 1), both exporting to the receiver."""
    roles = {"prefill": "0", "decode": "1"}
    tasks = {
        role: asyncio.create_task(
            start_tiny_vllm(
                data_dir,
                free_port(),
                role,  # type: ignore[arg-type]
                core,
                kv_cache_gib=0.25,
                max_model_len=1024,
                nixl_side_channel_port=free_port(),
                env=QUICK_EXPORT,
                progress=None,
                traces_endpoint=receiver.endpoint,
            )
        )
        for role, core in roles.items()
    }
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    started = {r: t.result() for r, t in tasks.items() if t.exception() is None}
    try:
        failed = [t.exception() for t in tasks.values() if t.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        yield started
    finally:
        await asyncio.gather(*(p.stop() for p in started.values()))


@pytest.fixture(scope="module")
def gateway_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traced")


@pytest.fixture(scope="module")
def gateway(
    pd_pair: dict[str, VllmProcess], receiver: OtlpReceiver, gateway_dir: Path
) -> Iterator[GatewayProcess]:
    tmp = gateway_dir
    config = tmp / "gateway.toml"
    config.write_text(
        f"""
data_dir = "{tmp}"
[tracing]
endpoint = "{receiver.endpoint}"
sample_ratio = 1.0
[[models]]
id = "tiny-chat"
backend = "tiny"
[[backends]]
kind = "vllm"
name = "tiny"
served_model = "{TINY_MODEL_NAME}"
revision = "test"
prefill_threshold_tokens = 16
cache_salt_secret = "test-secret"
read_timeout_s = 150.0
[[backends.servers]]
url = "{pd_pair["prefill"].url}"
role = "prefill"
[[backends.servers]]
url = "{pd_pair["decode"].url}"
role = "decode"
"""
    )
    running = GatewayProcess(config, env=QUICK_EXPORT).start()
    try:
        yield running
    finally:
        running.stop()


def chat(gateway: GatewayProcess, text: str, request_id: str, **headers: str) -> None:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 6,
        "stream": True,
    }
    with httpx.Client(timeout=300) as http:
        r = http.post(
            gateway.url + "/v1/chat/completions",
            json=body,
            headers={"x-request-id": request_id, **headers},
        )
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")


def root_span(receiver: OtlpReceiver, request_id: str) -> ReceivedSpan:
    """The gateway's server span of a request, once it has arrived."""

    def found() -> list[ReceivedSpan]:
        return receiver.matching(lambda s: s.attributes.get("semcache.request_id") == request_id)

    wait_until(found, SPANS_WAIT_S)
    (root,) = found()
    return root


def vllm_spans(receiver: OtlpReceiver, trace_id: str) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {"vllm-prefill": [], "vllm-decode": []}
    for span in receiver.trace(trace_id):
        if span.service in out:
            out[span.service].append(span)
    return out


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    (found,) = [s for s in spans if s.name == name]
    return found


def logged_trace_id(data_dir: Path, request_id: str) -> str | None:
    """The trace id on the request log's line of a request (written within 50 ms)."""
    log = data_dir / "logs" / "requests.jsonl"
    if not log.exists():
        return None
    lines = [orjson.loads(line) for line in log.read_text().splitlines() if line]
    found = [entry["trace_id"] for entry in lines if entry["request_id"] == request_id]
    return found[0] if found else None


def test_a_miss_is_one_trace_from_the_gateway_through_prefill_and_decode(
    gateway: GatewayProcess, receiver: OtlpReceiver, gateway_dir: Path
) -> None:
    chat(gateway, "Miss one. " + SENTENCE * 3, "miss-1")
    root = root_span(receiver, "miss-1")
    assert root.service == "semcache" and root.parent_id == ""
    assert root.attributes["semcache.cache"] == "miss"

    def both_servers() -> bool:
        found = vllm_spans(receiver, root.trace_id)
        return bool(found["vllm-prefill"] and found["vllm-decode"])

    wait_until(both_servers, SPANS_WAIT_S)
    spans = receiver.trace(root.trace_id)
    ours = [s for s in spans if s.service == "semcache"]
    prefill, decode = one(ours, "prefill"), one(ours, "decode")
    found = vllm_spans(receiver, root.trace_id)
    # vLLM's spans hang under the gateway's hop that called each server
    assert {s.parent_id for s in found["vllm-prefill"]} == {prefill.span_id}
    assert {s.parent_id for s in found["vllm-decode"]} == {decode.span_id}
    assert {s.name for s in found["vllm-decode"]} == {"llm_request"}
    # parent links intact: every span's parent is a span of this trace, up to the root
    ids = {s.span_id for s in spans}
    assert all(s.parent_id in ids for s in spans if s is not root)
    names = {s.name for s in ours}
    assert {"auth", "cache.exact", "placement", "kv.handoff", "stream"} <= names
    wait_until(lambda: logged_trace_id(gateway_dir, "miss-1") == root.trace_id)


def test_a_hit_is_a_trace_without_a_backend_span(
    gateway: GatewayProcess, receiver: OtlpReceiver
) -> None:
    """Counted once every span the hit could have caused is in: each server exports its spans
    in the order they end, from one queue, so once a later miss's vLLM spans arrived from
    both servers, any span of the hit's would have too. Checked against a hit that also asks
    vLLM in the background (a refresh started on a fresh hit): its spans join the hit's
    trace after the hit's root span arrived, and the test fails."""
    text = "Hit two. " + SENTENCE * 3
    chat(gateway, text, "hit-fill")
    filled = root_span(receiver, "hit-fill")
    wait_until(lambda: all(vllm_spans(receiver, filled.trace_id).values()), SPANS_WAIT_S)
    served = len(receiver.matching(lambda s: s.service.startswith("vllm-")))
    chat(gateway, text, "hit-1")
    root = root_span(receiver, "hit-1")
    assert root.attributes["semcache.cache"] == "exact"
    # the marker: a miss after the hit; its vLLM spans come after any of the hit's
    chat(gateway, "Marker. " + SENTENCE * 3, "hit-marker")
    marker = root_span(receiver, "hit-marker")
    wait_until(lambda: all(vllm_spans(receiver, marker.trace_id).values()), SPANS_WAIT_S)
    spans = receiver.trace(root.trace_id)
    assert {s.service for s in spans} == {"semcache"}
    assert not {"placement", "prefill", "decode", "kv.handoff", "stream"} & {s.name for s in spans}
    assert one(spans, "cache.exact").attributes["semcache.status"] == "HIT"
    # vLLM's spans since the fill are the marker's alone
    marked = sum(len(found) for found in vllm_spans(receiver, marker.trace_id).values())
    assert len(receiver.matching(lambda s: s.service.startswith("vllm-"))) == served + marked


def test_the_clients_traceparent_is_the_traces_parent(
    gateway: GatewayProcess, receiver: OtlpReceiver, gateway_dir: Path
) -> None:
    chat(
        gateway,
        "Client three. " + SENTENCE * 3,
        "client-1",
        traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    )
    root = root_span(receiver, "client-1")
    assert (root.trace_id, root.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    wait_until(lambda: all(vllm_spans(receiver, CLIENT_TRACE).values()), SPANS_WAIT_S)
    wait_until(lambda: logged_trace_id(gateway_dir, "client-1") == CLIENT_TRACE)


def test_batch_items_are_traces_of_their_own_linked_to_the_submit(
    gateway: GatewayProcess, receiver: OtlpReceiver
) -> None:
    items = [
        {
            "messages": [{"role": "user", "content": f"Batch item {i}. " + SENTENCE * 2}],
            "max_tokens": 4,
        }
        for i in range(2)
    ]
    with httpx.Client(timeout=60) as http:
        r = http.post(
            gateway.url + "/client/v4/accounts/a/ai/run/tiny-chat?queueRequest=true",
            json={"requests": items},
            headers={"x-request-id": "batch-submit-1", "authorization": "Bearer any"},
        )
    assert r.status_code == 200, r.text
    batch_id = r.json()["result"]["request_id"]
    root = root_span(receiver, "batch-submit-1")
    assert root.attributes["semcache.batch_id"] == batch_id

    def item_roots() -> list[ReceivedSpan]:
        return receiver.matching(
            lambda s: s.name == "batch item" and s.attributes.get("semcache.batch_id") == batch_id
        )

    wait_until(lambda: len(item_roots()) == 2, SPANS_WAIT_S * 3)
    submit = one(receiver.trace(root.trace_id), "batch.submit")
    assert submit.parent_id in {s.span_id for s in receiver.trace(root.trace_id)}
    roots = item_roots()
    assert sorted(s.attributes["semcache.batch_index"] for s in roots) == [0, 1]
    assert len({s.trace_id for s in roots} | {root.trace_id}) == 3  # one trace per item
    for item_root in roots:
        assert item_root.parent_id == ""  # a root of its own trace, linked to the submit
        assert item_root.links == ((submit.trace_id, submit.span_id),)
    # each item's trace runs through vLLM like a live request's
    wait_until(
        lambda: all(vllm_spans(receiver, s.trace_id)["vllm-decode"] for s in roots), SPANS_WAIT_S
    )
