"""The official openai SDK against the real gateway in front of a real vLLM server."""

from __future__ import annotations

import base64
import copy
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig
from tests.conftest import gateway_config

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the weather in spring."},
]


@pytest.fixture
def gw(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="test", max_retries=0)


@pytest.fixture
def direct(tiny_vllm: VllmProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_vllm.url}/v1", api_key="test", max_retries=0)


def strip_volatile(d: dict[str, Any]) -> dict[str, Any]:
    """Drop what differs between two identical requests (ids, times, prefix-cache hits)."""
    out = {k: v for k, v in d.items() if k not in ("id", "created", "model")}
    if out.get("usage"):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def test_models_list_and_retrieve(gw: openai.OpenAI) -> None:
    ids = [m.id for m in gw.models.list()]
    assert ids == ["tiny-chat", "all-MiniLM-L6-v2"]
    model = gw.models.retrieve("@cf/test/tiny")
    assert model.id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        gw.models.retrieve("nope")


def test_chat_matches_vllm_directly(gw: openai.OpenAI, direct: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    via = gw.chat.completions.create(model="tiny-chat", **kw)
    ref = direct.chat.completions.create(model=TINY_MODEL_NAME, **kw)
    assert via.choices[0].message.content
    assert strip_volatile(via.model_dump()) == strip_volatile(ref.model_dump())
    assert via.usage is not None and via.usage.completion_tokens == 24


def test_chat_stream_is_relayed_chunk_for_chunk(gw: openai.OpenAI, direct: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "messages": MESSAGES,
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def content(chunks: list[dict[str, Any]]) -> str:
        return "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])

    def text_only(chunk: dict[str, Any]) -> bool:
        choice = chunk["choices"][0] if len(chunk["choices"]) == 1 else None
        return bool(
            choice
            and choice["finish_reason"] is None
            and set(k for k, v in choice["delta"].items() if v is not None) <= {"content"}
        )

    def coalesced(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Consecutive text-only chunks joined into one: the stream with vLLM's chunking out."""
        out: list[dict[str, Any]] = []
        for chunk in map(strip_volatile, copy.deepcopy(chunks)):
            if out and text_only(out[-1]) and text_only(chunk):
                delta = out[-1]["choices"][0]["delta"]
                delta["content"] = (delta["content"] or "") + (
                    chunk["choices"][0]["delta"]["content"] or ""
                )
            else:
                out.append(chunk)
        return out

    # vLLM merges the deltas of several tokens into one event when its own reader lags (a
    # loaded machine), so two identical requests can be chunked differently upstream. The
    # text and every other field must always match; the chunking must match when the two
    # streams came out of vLLM alike (on one of a few tries, else only with it joined).
    for _ in range(4):
        via = [c.model_dump() for c in gw.chat.completions.create(model="@cf/test/tiny", **kw)]
        ref = [c.model_dump() for c in direct.chat.completions.create(model=TINY_MODEL_NAME, **kw)]
        assert content(via) == content(ref)
        assert coalesced(via) == coalesced(ref)
        if len(via) == len(ref):
            assert [strip_volatile(c) for c in via] == [strip_volatile(c) for c in ref]
            break
    assert via[-1]["usage"]["completion_tokens"] == 20
    text = content(via)
    plain = gw.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=20, temperature=0
    )
    assert text == plain.choices[0].message.content


def test_completions_plain_and_stream(gw: openai.OpenAI, direct: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    via = gw.completions.create(model="tiny-chat", **kw)
    ref = direct.completions.create(model=TINY_MODEL_NAME, **kw)
    assert strip_volatile(via.model_dump()) == strip_volatile(ref.model_dump())
    chunks = list(gw.completions.create(model="tiny-chat", stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == via.choices[0].text


def test_pass_through_fields_reach_vllm(gw: openai.OpenAI) -> None:
    r = gw.chat.completions.create(
        model="tiny-chat",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.8,
        seed=42,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(r.choices) == 2
    assert r.choices[0].logprobs is not None
    assert len(r.choices[0].logprobs.content or []) > 0
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2  # type: ignore[index]
    again = gw.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0.8, seed=42, n=2
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_json_schema_response_format_passes_through(gw: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 5}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = gw.chat.completions.create(
        model="tiny-chat",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    import json

    content = r.choices[0].message.content or ""
    if r.choices[0].finish_reason == "stop":
        assert set(json.loads(content)) == {"answer"}
    else:
        assert content.startswith("{")


def test_vllm_rejection_is_relayed_in_openai_shape(gw: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        gw.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=100_000)
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        gw.chat.completions.create(
            model="tiny-chat", messages=MESSAGES, max_tokens=100_000, stream=True
        )


def test_embeddings_string_and_list(gw: openai.OpenAI, gateway: GatewayProcess) -> None:
    one = gw.embeddings.create(model="all-MiniLM-L6-v2", input="The cat sat on the mat.")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    many = gw.embeddings.create(
        model="all-MiniLM-L6-v2",
        input=["The cat sat on the mat.", "A dog barked.", "Stocks fell sharply."],
    )
    assert [d.index for d in many.data] == [0, 1, 2]
    v = np.array([d.embedding for d in many.data])
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert np.allclose(v[0], one.data[0].embedding, atol=1e-5)
    assert many.usage.prompt_tokens > one.usage.prompt_tokens > 0
    # float format over raw HTTP matches the SDK's default base64 transfer
    raw = httpx.post(
        f"{gateway.url}/v1/embeddings",
        json={"model": "all-MiniLM-L6-v2", "input": "A dog barked.", "encoding_format": "float"},
    ).json()
    assert np.allclose(raw["data"][0]["embedding"], v[1], atol=1e-6)
    b64 = httpx.post(
        f"{gateway.url}/v1/embeddings",
        json={"model": "all-MiniLM-L6-v2", "input": "A dog barked.", "encoding_format": "base64"},
    ).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, v[1], atol=1e-6)


def test_client_disconnect_cancels_backend_request(
    tiny_vllm: VllmProcess,
    data_dir: Path,
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    """On the tiny vLLM pinned to one core: unpinned, its threads starve the gateway process,
    which then sees the client leave only once vLLM has finished the answer."""
    model = data_dir / "models" / TINY_MODEL_NAME
    gateway = start_gateway(gateway_config(tmp_path / "data", tiny_vllm.url, model))

    def generated() -> float:
        text = httpx.get(f"{tiny_vllm.url}/metrics").text
        return parse_metric(text, "vllm:generation_tokens_total")

    def leave_after_three_chunks() -> float:
        """Tokens vLLM generated for a stream whose client left after 3 chunks (settled)."""
        body = {
            "model": "tiny-chat",
            # a prompt of its own: a cached answer (temperature 0) would never reach vLLM
            "messages": [{"role": "user", "content": f"Tell me a long story {uuid.uuid4().hex}."}],
            "max_tokens": 1500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        before = generated()
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_raw()):
                if n == 3:
                    break
        # vLLM signals no event when an aborted request stops: only a counter that stays put.
        time.sleep(2)
        settled = generated()
        time.sleep(2)
        assert generated() == settled  # nothing still running
        return settled - before

    # The client has gone: vLLM stops generating far short of 1500 tokens. On a quiet machine
    # the tiny model can finish its answer (about 1.7 s) before the gateway sees the client
    # leave, so the cut gets 3 tries; a gateway that never aborts fails all of them.
    counts = []
    for _ in range(3):
        counts.append(leave_after_three_chunks())
        if counts[-1] < 1500:
            break
    assert counts[-1] < 1500, counts


def test_metrics_page_counts_requests(gw: openai.OpenAI, gateway: GatewayProcess) -> None:
    gw.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, temperature=0)
    text = httpx.get(f"{gateway.url}/metrics").text
    completion = {"model": "tiny-chat", "kind": "completion"}
    assert parse_metric(text, "semcache_tokens_total", completion) >= 4
    assert parse_metric(text, "semcache_request_duration_seconds_count", {"route": "chat"}) >= 1
    assert httpx.get(f"{gateway.url}/ready").status_code == 200
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
