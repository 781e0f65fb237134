"""``/v1/messages`` over HTTP on the app ``semcache serve`` builds, with a fake chat backend
(the surface is what these tests are about; ``test_anthropic_sdk.py`` drives real vLLM):
who a key is, and Anthropic's error shape."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from backends.interfaces import BackendError
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from harness.gateway import GatewayThread
from server.config import parse_config

BODY = {
    "model": "chat-model",
    "max_tokens": 8,
    "temperature": 0,
    "messages": [{"role": "user", "content": "hi"}],
}
CHAT = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
CLOSED = '[[auth.tokens]]\ntoken = "tok-a"\ntenant = "acme"\n'

Start = Callable[..., GatewayThread]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    started: list[GatewayThread] = []

    def run(extra: str = "", fake: FakeGeneration | None = None) -> GatewayThread:
        reg = ModelRegistry()
        reg.generation["fake"] = fake or FakeGeneration()
        reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
        data_dir = tmp_path / f"gw{len(started)}"
        toml = f'data_dir = "{data_dir}"\n{extra}'
        gw = GatewayThread(parse_config(tomllib.loads(toml)), reg).start()
        started.append(gw)
        return gw

    try:
        yield run
    finally:
        for gw in started:
            gw.stop()


def status(r: httpx.Response) -> str:
    return r.headers.get("cf-aig-cache-status", "")


def test_x_api_key_and_bearer_are_one_tenant_on_the_messages_routes_only(start: Start) -> None:
    fake = FakeGeneration()
    gw = start(fake=fake)  # open: a key is a tenant of its own
    with httpx.Client(base_url=gw.url) as http:
        first = http.post("/v1/messages", json=BODY, headers={"x-api-key": "key-1"})
        assert first.status_code == 200, first.text
        assert first.json()["content"] == [{"type": "text", "text": "hello"}]
        assert status(first) == "MISS"
        bearer = http.post("/v1/messages", json=BODY, headers={"authorization": "Bearer key-1"})
        assert status(bearer) == "HIT"
        chat = http.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer key-1"}
        )
        assert status(chat) == "MISS"  # no max_tokens: another request
        twin = {**CHAT, "max_tokens": 8}
        shared = http.post(
            "/v1/chat/completions", json=twin, headers={"authorization": "Bearer key-1"}
        )
        assert status(shared) == "HIT"  # the Messages request's entry
        ignored = http.post("/v1/chat/completions", json=twin, headers={"x-api-key": "key-1"})
        assert status(ignored) == "MISS"  # not key-1's tenant: x-api-key means nothing here
        other = http.post("/v1/messages", json=BODY, headers={"x-api-key": "key-2"})
        assert status(other) == "MISS"
    assert first.headers["vary"] == "Authorization, x-api-key"


def test_errors_come_in_anthropics_shape(start: Start) -> None:
    fake = FakeGeneration()
    gw = start(CLOSED, fake)
    with httpx.Client(base_url=gw.url) as http:
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
            r = http.post("/v1/messages", json=BODY, headers=headers)
            assert r.status_code == 401
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
        ok = {"x-api-key": "tok-a", "anthropic-version": "2023-06-01", "anthropic-beta": "x"}
        assert http.post("/v1/messages", json=BODY, headers=ok).status_code == 200
        assert http.post("/v1/chat/completions", json=CHAT, headers=ok).status_code == 401

        def refused(body: object, code: int, kind: str, *, raw: bytes | None = None) -> str:
            if raw is not None:
                r = http.post("/v1/messages", content=raw, headers=ok)
            else:
                r = http.post("/v1/messages", json=body, headers=ok)
            assert r.status_code == code, r.text
            assert set(r.json()) == {"type", "error"} and r.json()["error"]["type"] == kind
            message: str = r.json()["error"]["message"]
            return message

        assert "max_tokens" in refused({**BODY, "max_tokens": None}, 400, "invalid_request_error")
        assert "messages" in refused({**BODY, "messages": []}, 400, "invalid_request_error")
        assert "temperature" in refused({**BODY, "temperature": 1.5}, 400, "invalid_request_error")
        refused(None, 400, "invalid_request_error", raw=b"{not json")
        assert "nope" in refused({**BODY, "model": "nope"}, 404, "not_found_error")
        fake.fail = BackendError("overloaded", "every server is busy", retry_after_s=1)
        refused({**BODY, "max_tokens": 9}, 529, "overloaded_error")
        fake.fail = BackendError("unreachable", "connection refused")
        refused({**BODY, "max_tokens": 10}, 502, "api_error")
        count = http.post(
            "/v1/messages/count_tokens", json={"model": "nope", "messages": []}, headers=ok
        )
        assert count.status_code == 400 and count.json()["error"]["type"] == "invalid_request_error"


def test_a_stream_is_anthropics_event_sequence(start: Start) -> None:
    gw = start()
    with httpx.Client(base_url=gw.url) as http:
        names = []
        for _ in range(2):  # a miss, then the replayed hit: the same events
            with http.stream(
                "POST", "/v1/messages", json={**BODY, "stream": True}, headers={"x-api-key": "k"}
            ) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                names.append([line[7:] for line in r.iter_lines() if line.startswith("event: ")])
    assert (
        names[0]
        == names[1]
        == [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    )


def test_repeats_are_sent_from_the_entrys_rendering_byte_for_byte(start: Start) -> None:
    """The early hits keep an entry's Messages rendering on the entry: the third request (sent
    from it) is the second's bytes (translated), stream and JSON alike."""
    gw = start()
    with httpx.Client(base_url=gw.url) as http:
        for stream in (True, False):
            bodies, statuses = [], []
            for _ in range(3):  # a miss, a hit that renders, a hit sent from the rendering
                r = http.post(
                    "/v1/messages", json={**BODY, "stream": stream}, headers={"x-api-key": "k"}
                )
                bodies.append(r.content)
                statuses.append(r.headers.get("cf-aig-cache-status"))
            assert statuses[1:] == ["HIT", "HIT"]
            assert bodies[2] == bodies[1]
            if stream:
                assert bodies[2].endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
            else:
                assert orjson.loads(bodies[2])["type"] == "message"
