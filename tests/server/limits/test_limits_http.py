"""Limits through the app ``semcache serve`` builds: a real HTTP server on loopback, its config
from TOML, a fake chat backend (the backend is not what these tests are about)."""

from __future__ import annotations

import asyncio
import threading
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from harness.fake_vllm import FakeGeneration, FakeStream, FakeVllm
from harness.gateway import GatewayProcess, GatewayThread
from server.config import GatewayConfig, parse_config
from server.limits.limiter import estimate_tokens
from tests.semcache.conftest import RedisServer
from tests.support.headers import bearer
from tests.support.waiting import wait_until

CHAT = "/v1/chat/completions"
RUN = "/client/v4/accounts/ACC/ai/run/@cf/test/chat"
RATE_HEADERS = {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"}


def registry(fake: FakeGeneration) -> ModelRegistry:
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    return reg


GatewayFactory = Callable[..., GatewayThread]
NOON = datetime(2026, 3, 14, 12, tzinfo=UTC).timestamp()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayFactory]:
    """Start gateways from TOML text (each on its own data dir); all stop at the end."""
    started: list[GatewayThread] = []

    def start(
        toml: str, fake: FakeGeneration | None = None, clock: Callable[[], float] = time.time
    ) -> GatewayThread:
        data_dir = tmp_path / f"gw{len(started)}"
        doc = tomllib.loads(f'data_dir = "{data_dir}"\n' + toml)
        config = parse_config(doc)
        gw = GatewayThread(config, registry(fake or FakeGeneration()), clock=clock).start()
        started.append(gw)
        return gw

    try:
        yield start
    finally:
        for gw in started:
            gw.stop()


def chat(content: str = "hi", **extra: Any) -> bytes:
    body = {"model": "chat-model", "messages": [{"role": "user", "content": content}]}
    return orjson.dumps({**body, "temperature": 0, **extra})


TWO_TOKENS = """
[limits]
requests_per_minute = 100
[[auth.tokens]]
token = "tok-a"
tenant = "acme"
name = "a"
limits = { requests_per_minute = 2 }
[[auth.tokens]]
token = "tok-b"
tenant = "globex"
"""


def test_over_the_limit_is_a_429_in_each_routes_format(gateway: GatewayFactory) -> None:
    gw = gateway(TWO_TOKENS)
    with httpx.Client(base_url=gw.url) as http:
        first = http.post(CHAT, content=chat(), headers=bearer("tok-a", json=True))
        assert first.status_code == 200, first.text
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"] in {"1m0s", "59s", "58s"}
        assert "x-ratelimit-limit-tokens" not in first.headers  # no token limit configured
        # A cache hit counts as a request too.
        second = http.post(CHAT, content=chat(), headers=bearer("tok-a", json=True))
        assert second.status_code == 200
        assert second.headers["x-ratelimit-remaining-requests"] == "0"

        refused = http.post(CHAT, content=chat("other"), headers=bearer("tok-a", json=True))
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-limit-requests"] == "2"
        error = refused.json()["error"]
        assert (error["code"], error["type"], error["param"]) == (
            "rate_limit_exceeded",
            "requests",
            None,
        )
        assert error["message"].startswith("Rate limit reached for requests per min (RPM)")

        envelope = http.post(RUN, content=b'{"prompt": "hi"}', headers=bearer("tok-a", json=True))
        assert envelope.status_code == 429
        assert envelope.headers["x-ratelimit-remaining-requests"] == "0"
        assert "retry-after" in envelope.headers
        body = envelope.json()
        assert body["success"] is False and body["result"] is None
        assert body["errors"][0]["code"] == 4290

        # Another token has its own window (the default); a request without a token is a 401
        # and counts for nobody; a public route carries no limit headers.
        other = http.post(RUN, content=b'{"prompt": "hi"}', headers=bearer("tok-b", json=True))
        assert other.status_code == 200, other.text
        assert other.headers["x-ratelimit-limit-requests"] == "100"
        assert other.headers["x-ratelimit-remaining-requests"] == "99"
        anonymous = http.post(CHAT, content=chat(), headers={"content-type": "application/json"})
        assert anonymous.status_code == 401
        assert not RATE_HEADERS & set(anonymous.headers)
        assert not RATE_HEADERS & set(http.get("/health").headers)
        again = http.post(CHAT, content=chat(), headers=bearer("tok-b", json=True))
        assert again.headers["x-ratelimit-remaining-requests"] == "98"

    lines = list(gw.app.state.envelope.request_log.recent)
    assert [line["cache"] for line in lines[:2]] == ["miss", "exact"]
    refusals = [line for line in lines if line["status"] == 429]
    assert [(r["token"], r["route"], r["error_code"]) for r in refusals] == [
        ("a", CHAT, "rate_limit_exceeded"),
        ("a", "/client/v4/accounts/{account_id:str}/ai/run/{model:path}", "rate_limit_exceeded"),
    ]


def test_tokens_per_minute_estimates_then_counts_the_usage(gateway: GatewayFactory) -> None:
    gw = gateway(
        """
[limits]
tokens_per_minute = 2000
[[auth.tokens]]
token = "tok"
tenant = "acme"
"""
    )
    body = chat("tell me", max_tokens=100)
    estimate = len(body) // 4 + 100
    with httpx.Client(base_url=gw.url) as http:
        miss = http.post(CHAT, content=body, headers=bearer("tok", json=True))
        assert miss.status_code == 200
        assert miss.json()["usage"]["total_tokens"] == 4
        assert miss.headers["x-ratelimit-limit-tokens"] == "2000"
        assert miss.headers["x-ratelimit-remaining-tokens"] == str(2000 - estimate)
        # The estimate was replaced by the 4 tokens used; a hit spends none (by default).
        hit = http.post(CHAT, content=body, headers=bearer("tok", json=True))
        assert hit.headers["x-ratelimit-remaining-tokens"] == str(2000 - 4 - estimate)
        big = chat("x" * 8000, max_tokens=10)
        too_big = http.post(CHAT, content=big, headers=bearer("tok", json=True))
        assert too_big.status_code == 429
        assert too_big.json()["error"]["type"] == "tokens"
        assert too_big.headers["x-ratelimit-remaining-tokens"] == str(2000 - 4)
        assert too_big.headers["x-ratelimit-reset-tokens"].endswith("s")


FAKE_VLLM = """
[[models]]
id = "chat-model"
backend = "fake"
aliases = ["@cf/test/chat"]
[[backends]]
kind = "vllm"
name = "fake"
served_model = "m"
scrape_metrics = false
[[backends.servers]]
url = "{url}"
"""


@pytest.fixture
def fake_vllm() -> Iterator[FakeVllm]:
    server = FakeVllm()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_two_gateways_on_one_redis_enforce_one_limit(
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
    fake_vllm: FakeVllm,
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    """Two ``semcache serve`` processes (a stand-in vLLM behind them) share one limit."""

    def gateway(toml: str, name: str) -> GatewayProcess:
        doc = tomllib.loads(
            f'data_dir = "{tmp_path / name}"\n' + toml + FAKE_VLLM.format(url=fake_vllm.url)
        )
        return start_gateway(parse_config(doc))

    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'version = 1\n[tiers.redis]\nurl = "{redis_server.url}"\nprefix = "{redis_prefix}"\n'
    )
    toml = f"""
policy = "{policy}"
[limits]
requests_per_minute = 5
[[auth.tokens]]
token = "tok"
tenant = "acme"
"""
    gateways = [gateway(toml, "gw0"), gateway(toml, "gw1")]
    statuses: list[int] = []
    remaining: list[str] = []
    with httpx.Client() as http:
        for i in range(12):
            gw = gateways[i % 2]
            if i % 3:
                r = http.post(
                    gw.url + CHAT, content=chat(f"q{i}"), headers=bearer("tok", json=True)
                )
            else:
                r = http.post(
                    gw.url + RUN, content=b'{"prompt": "hi"}', headers=bearer("tok", json=True)
                )
            statuses.append(r.status_code)
            remaining.append(r.headers["x-ratelimit-remaining-requests"])
    assert statuses == [200] * 5 + [429] * 7
    assert remaining == ["4", "3", "2", "1", "0"] + ["0"] * 7


class GatedStream(FakeStream):
    """A stream that stops after its first chunk until the test opens the gate."""

    def __init__(self, chunks: list[bytes], gate: threading.Event) -> None:
        super().__init__(chunks)
        self.gate = gate

    async def chunks(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self._chunks):
            if i == 1:
                await asyncio.to_thread(self.gate.wait, 30)
            yield chunk


class GatedStreams(FakeGeneration):
    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    async def open_stream(self, path: str, body: dict[str, Any], ctx: RequestContext) -> FakeStream:
        opened = await super().open_stream(path, body, ctx)
        return GatedStream(opened._chunks, self.gate)


def test_a_reached_budget_refuses_the_next_request_and_a_stream_in_flight_ends_normally(
    gateway: GatewayFactory,
) -> None:
    fake = GatedStreams()
    body = chat("a long story", stream=True)
    # The stream in flight holds its worst case (its estimate) on the day's charge until it
    # ends; "one" and "two" settle to 4 tokens each (the fake's usage): then the charge is
    # the budget.
    budget = estimate_tokens(body) + 8
    gw = gateway(
        f"""
[limits]
daily_tokens = {budget}
requests_per_minute = 100
[[auth.tokens]]
token = "tok"
tenant = "acme"
""",
        fake,
        clock=lambda: NOON,  # the budget's day, whenever the test runs
    )
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        with http.stream("POST", CHAT, content=body, headers=bearer("tok", json=True)) as stream:
            assert stream.status_code == 200
            events = stream.iter_lines()
            assert next(events).startswith("data: ")  # the stream is in flight
            for content in ("one", "two"):
                assert http.post(
                    CHAT, content=chat(content), headers=bearer("tok", json=True)
                ).is_success
            refused = http.post(CHAT, content=chat("three"), headers=bearer("tok", json=True))
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == str(12 * 3600)  # noon to midnight
            assert refused.headers["x-ratelimit-remaining-requests"] == "97"
            error = refused.json()["error"]
            assert (error["code"], error["type"]) == ("insufficient_quota", "insufficient_quota")
            assert f"daily budget of {budget} tokens (charged {budget})" in error["message"]
            assert "renews at 2026-03-15T00:00:00Z" in error["message"]
            envelope = http.post(RUN, content=b'{"prompt": "hi"}', headers=bearer("tok", json=True))
            assert envelope.status_code == 429
            assert envelope.json()["errors"][0]["code"] == 4290
            fake.gate.set()
            rest = [line for line in events if line]
        assert rest[-1] == "data: [DONE]"
    log = gw.app.state.envelope.request_log.recent

    def answered() -> list[bool]:  # the stream's line is written once its answer has ended
        return [line["completed"] for line in log if line["status"] == 200]

    wait_until(lambda: len(answered()) == 3)
    assert answered() == [True, True, True]


def test_a_stream_holds_its_concurrency_slot_to_its_end(gateway: GatewayFactory) -> None:
    fake = GatedStreams()
    gw = gateway(
        """
[[auth.tokens]]
token = "tok"
tenant = "acme"
limits = { concurrent_requests = 1 }
""",
        fake,
    )
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        body = chat("a long story", stream=True)
        with http.stream("POST", CHAT, content=body, headers=bearer("tok", json=True)) as stream:
            events = stream.iter_lines()
            assert next(events).startswith("data: ")
            busy = http.post(CHAT, content=chat("meanwhile"), headers=bearer("tok", json=True))
            assert busy.status_code == 429
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "rate_limit_exceeded"
            fake.gate.set()
            assert [line for line in events if line][-1] == "data: [DONE]"
        assert (
            http.post(CHAT, content=chat("after"), headers=bearer("tok", json=True)).status_code
            == 200
        )
