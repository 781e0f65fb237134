"""The one fake vLLM answers in vLLM's shapes, holds and releases answers, and goes down."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from harness.fake_vllm import FakeServer, FakeVllm, sse
from tests.support.waiting import wait_until


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    server = FakeVllm("tiny", usage=(3, 2)).start()
    try:
        yield server
    finally:
        server.stop()


def chat(url: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)


def events(raw: bytes) -> list[dict[str, Any]]:
    payloads = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert payloads[-1] == b"[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


def test_chat_answers_a_new_text_each_call_with_its_usage(fake: FakeVllm) -> None:
    first, second = chat(fake.url).json(), chat(fake.url).json()
    assert first["object"] == "chat.completion" and first["model"] == "tiny"
    texts = [doc["choices"][0]["message"]["content"] for doc in (first, second)]
    assert texts == ["answer 0", "answer 1"] and fake.calls == 2
    assert first["choices"][0]["finish_reason"] == "stop"
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_a_stream_is_one_word_an_event_then_the_usage_asked_for() -> None:
    fake = FakeVllm("tiny", text="three short words", finish_reason="length").start()
    try:
        plain = events(chat(fake.url, stream=True).content)
        asked = events(chat(fake.url, stream=True, stream_options={"include_usage": True}).content)
    finally:
        fake.stop()
    words = [e["choices"][0]["delta"]["content"] for e in plain]
    assert words == ["three", " short", " words"]
    assert [e["choices"][0]["finish_reason"] for e in plain] == [None, None, "length"]
    assert asked[:-1] == plain and asked[-1]["choices"] == [] and "usage" in asked[-1]


def test_held_answers_wait_for_the_release() -> None:
    fake = FakeVllm("tiny", text="held answer", hold=True).start()
    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda s=s: answers.append(chat(fake.url, stream=s)))
        for s in (False, True)
    ]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: fake.held == 2, timeout_s=10)
        assert not answers
        fake.release()
        for t in threads:
            t.join(10)
    finally:
        fake.stop()
    assert len(answers) == 2 and all(a.status_code == 200 for a in answers) and fake.held == 0


def test_models_and_version_report_the_root_a_restart_may_change(fake: FakeVllm) -> None:
    models = httpx.get(f"{fake.url}/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [("tiny", "/models/a")]
    fake.root = "/models/b"
    assert httpx.get(f"{fake.url}/v1/models").json()["data"][0]["root"] == "/models/b"
    assert httpx.get(f"{fake.url}/version").json()["version"]
    assert httpx.get(f"{fake.url}/health").status_code == 200


async def test_a_fake_server_goes_down_and_comes_back_on_its_port() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, b"data: 1\n\n", b"data: [DONE]\n\n")

    server = FakeServer(handler)
    await server.start()
    async with httpx.AsyncClient(timeout=5) as client:
        assert (await client.get(server.url)).text == "data: 1\n\ndata: [DONE]\n\n"
        await server.stop()
        with pytest.raises(httpx.ConnectError):
            await client.get(server.url)
        await server.start()
        assert server.up and (await client.get(server.url)).status_code == 200
    await server.stop()
