"""Exact hits answered before routing, through the app ``semcache serve`` builds: a real HTTP
server on loopback, its config from TOML, a fake chat backend and the local MiniLM embedder
(the backends are not what these tests are about; ``tests/server/test_cache_http.py`` sends
repeats through real vLLM)."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from harness.gateway import GatewayThread
from harness.metrics import parse_metric
from server.config import parse_config
from tests.support.waiting import wait_until

ADMIN = "tok-admin"
TOKENS = f"""
[request_log]
enabled = true
[ledger]
enabled = true
[limits]
requests_per_minute = 1000
tokens_per_minute = 1_000_000
[[auth.tokens]]
token = "tok-a"
tenant = "acme"
name = "a"
[[auth.tokens]]
token = "tok-b"
tenant = "globex"
name = "b"
[[auth.tokens]]
token = "tok-tight"
tenant = "acme"
name = "tight"
limits = {{ requests_per_minute = 2 }}
[[auth.tokens]]
token = "{ADMIN}"
tenant = "ops"
roles = ["admin"]
"""
POLICY = """
version = 1
[defaults]
ttl_s = 600
[defaults.prices]
input_per_m = 1.0
output_per_m = 2.0
"""
VARYING = {"x-request-id", "date", "etag", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"}
"""Headers that differ between two gateways' answers: the ETag names the stored entry, and
each gateway's rate windows began when its first request came."""
CHAT = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
CASES = {
    "chat": ("/v1/chat/completions", CHAT, "chat"),
    "chat stream": ("/v1/chat/completions", {**CHAT, **STREAM}, "chat"),
    "completions": (
        "/v1/completions",
        {"model": "chat-model", "prompt": "hi", "temperature": 0},
        "completions",
    ),
    "completions stream": (
        "/v1/completions",
        {"model": "chat-model", "prompt": "hi", "temperature": 0, "stream": True},
        "completions",
    ),
    "embeddings": (
        "/v1/embeddings",
        {"model": "embed-model", "input": ["hello", "world"]},
        "embeddings",
    ),
    "messages": ("/v1/messages", {**CHAT, "max_tokens": 8}, "chat"),
    "messages stream": ("/v1/messages", {**CHAT, "max_tokens": 8, "stream": True}, "chat"),
}
"""Request bodies by case: (path, body, the cache's route name)."""


def registry(fake: FakeGeneration, embedder: LocalEmbeddingBackend) -> ModelRegistry:
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.embedding["minilm"] = embedder
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", (), "t", "minilm", "r", "n"))
    return reg


Start = Callable[..., GatewayThread]


@pytest.fixture
def start(tmp_path: Path, embedder: LocalEmbeddingBackend) -> Iterator[Start]:
    """Start gateways from TOML text, each on its own data dir and policy file."""
    started: list[GatewayThread] = []

    def run(extra: str = "", fake: FakeGeneration | None = None) -> GatewayThread:
        data_dir = tmp_path / f"gw{len(started)}"
        data_dir.mkdir()
        (data_dir / "policy.toml").write_text(POLICY)
        toml = f'data_dir = "{data_dir}"\npolicy = "{data_dir / "policy.toml"}"\n{extra}'
        reg = registry(fake or FakeGeneration(), embedder)
        gw = GatewayThread(parse_config(tomllib.loads(toml)), reg).start()
        started.append(gw)
        return gw

    try:
        yield run
    finally:
        for gw in started:
            gw.stop()


def post(http: httpx.Client, path: str, body: Any, token: str = "tok-a", **headers: str) -> Any:
    sent = {"authorization": f"Bearer {token}", "content-type": "application/json", **headers}
    return http.post(path, content=orjson.dumps(body), headers=sent)


def early(http: httpx.Client, route: str) -> float:
    text = http.get("/metrics").text
    return parse_metric(text, "semcache_early_hits_total", {"route": route}) or 0.0


def metric(http: httpx.Client, name: str, labels: dict[str, str]) -> float:
    return parse_metric(http.get("/metrics").text, name, labels) or 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_a_repeat_is_answered_early_as_the_route_answers_it(start: Start, case: str) -> None:
    path, body, route = CASES[case]
    fakes = [FakeGeneration(), FakeGeneration()]
    gateways = [start(TOKENS, fakes[0]), start(TOKENS + "[server]\nearly_hits = false\n", fakes[1])]
    answers = []
    for gw in gateways:
        with httpx.Client(base_url=gw.url) as http:
            sent = [post(http, path, body) for _ in range(3)]
            assert [r.headers["cf-aig-cache-status"] for r in sent] == ["MISS", "HIT", "HIT"]
            answers.append((sent[2], early(http, route)))
            # a cache header sends it through the route: the same entry, the same ETag
            routed_here = post(http, path, body, **{"cache-control": "max-age=3600"})
            assert routed_here.headers["cf-aig-cache-status"] == "HIT"
            assert routed_here.headers.get("etag") == sent[2].headers.get("etag")
    (fast, fast_count), (routed, routed_count) = answers
    assert (fast_count, routed_count) == (1.0, 0.0)  # the route's hit taught the third
    assert len(fakes[0].calls) == len(fakes[1].calls) == (0 if case == "embeddings" else 1)
    assert fast.status_code == routed.status_code == 200
    assert fast.content == routed.content
    kept = [{k: v for k, v in r.headers.items() if k not in VARYING} for r in (fast, routed)]
    assert kept[0] == kept[1]
    assert kept[0]["x-ratelimit-remaining-requests"] == "997"
    assert fast.headers["x-request-id"] != routed.headers["x-request-id"]

    # Accounted alike: requests, latency, cache metrics, the request log and the ledger.
    admin = {"authorization": f"Bearer {ADMIN}"}
    counted: list[tuple[float, ...]] = []
    logs: list[list[dict[str, Any]]] = []
    for gw in gateways:
        with httpx.Client(base_url=gw.url) as http:
            model = body["model"]
            counted.append(
                (
                    metric(http, "semcache_requests_total", {"route": path, "status": "200"}),
                    metric(http, "semcache_request_duration_seconds_count", {"route": route}),
                    metric(http, "semcache_exact_hits_total", {"model": model, "tier": "memory"}),
                    metric(http, "semcache_exact_misses_total", {"model": model}),
                )
            )
            log = http.get("/admin/logs", headers=admin).json()["data"]
            logs.append([line for line in log if line["route"] == path])
    assert counted[0] == counted[1]
    assert counted[0][0] == 4.0 and counted[0][2:] == (3.0, 1.0)
    varying = {"request_id", "time", "latency_ms", "ttft_ms"}
    lines = [[{k: v for k, v in x.items() if k not in varying} for x in log] for log in logs]
    assert lines[0] == lines[1]
    assert sorted(x["cache"] for x in lines[0]) == ["exact", "exact", "exact", "miss"]

    def usage(gw: GatewayThread) -> Any:
        with httpx.Client(base_url=gw.url) as http:
            got = http.get("/v1/usage", headers={"authorization": "Bearer tok-a"})
            assert got.status_code == 200, got.text
            return got.json()["data"]

    wait_until(lambda: usage(gateways[0]) == usage(gateways[1]) != [], timeout_s=10)


def test_a_purge_a_new_revision_or_a_policy_reload_is_seen_at_once(start: Start) -> None:
    fake = FakeGeneration()
    gw = start(TOKENS, fake)
    path, body, _ = CASES["chat"]
    admin = {"authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=gw.url) as http:

        def statuses(n: int) -> list[str]:
            return [post(http, path, body).headers["cf-aig-cache-status"] for _ in range(n)]

        assert statuses(3) == ["MISS", "HIT", "HIT"]
        assert early(http, "chat") == 1.0
        purged = http.post(
            "/admin/cache/purge", json={"kind": "model", "target": "chat-model"}, headers=admin
        )
        assert purged.status_code == 200, purged.text
        assert statuses(3) == ["MISS", "HIT", "HIT"]
        assert len(fake.calls) == 2
        assert early(http, "chat") == 2.0  # learned again after the purge

        gw.app.state.registry.set_revision("fake", "rev2")  # what a server's new weights do
        assert statuses(3) == ["MISS", "HIT", "HIT"]
        assert len(fake.calls) == 3
        assert early(http, "chat") == 3.0

        reloaded = http.post("/admin/policy/reload", headers=admin)
        assert reloaded.status_code == 200, reloaded.text
        assert statuses(1) == ["HIT"]
        assert early(http, "chat") == 3.0  # the route answered: the memo was of the old policy
        assert statuses(1) == ["HIT"]
        assert early(http, "chat") == 4.0


def test_cache_headers_and_other_tenants_take_the_route(start: Start) -> None:
    fake = FakeGeneration()
    gw = start(TOKENS, fake)
    path, body, _ = CASES["chat"]
    with httpx.Client(base_url=gw.url) as http:
        for _ in range(3):
            assert post(http, path, body).status_code == 200
        assert early(http, "chat") == 1.0
        bypass = post(http, path, body, **{"cache-control": "no-cache"})
        assert bypass.headers["cf-aig-cache-status"] == "BYPASS"
        assert post(http, path, body, **{"cf-aig-cache-ttl": "60"}).status_code == 200
        # another tenant's identical bytes are its own request: a miss, never acme's answer
        other = post(http, path, body, token="tok-b")
        assert other.headers["cf-aig-cache-status"] == "MISS"
        assert post(http, path, body, token="tok-unknown").status_code == 401
        assert early(http, "chat") == 1.0


def test_a_limit_reached_on_an_early_hit_is_refused_by_the_route(start: Start) -> None:
    gw = start(TOKENS)
    path, body, _ = CASES["chat"]
    with httpx.Client(base_url=gw.url) as http:
        post(http, path, body)  # tok-a: the answer is cached
        post(http, path, body)  # its hit teaches the body to a's memo
        # a memo per key (a share group may name some of a tenant's keys): tight's first
        # hit takes the route and teaches its own
        assert post(http, path, body, token="tok-tight").headers["cf-aig-cache-status"] == "HIT"
        assert early(http, "chat") == 0.0
        second = post(http, path, body, token="tok-tight")
        assert second.status_code == 200
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        refused = post(http, path, body, token="tok-tight")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
        assert early(http, "chat") == 1.0
        requests = {"route": path, "status": "429"}
        assert metric(http, "semcache_requests_total", requests) == 1.0


def test_every_request_is_authenticated_once(start: Start) -> None:
    """A miss, the first repeat (the route answers it and its hit teaches the memo) and an
    early hit: each request's token is checked once, by the early hits or the envelope."""
    gw = start(TOKENS)
    auth = gw.app.state.auth
    checks: list[str] = []
    authenticate = auth.authenticate

    def counted(*args: Any, **kwargs: Any) -> Any:
        principal = authenticate(*args, **kwargs)
        checks.append(principal.token_id)
        return principal

    auth.authenticate = counted
    path, body, _ = CASES["chat"]
    with httpx.Client(base_url=gw.url) as http:
        for n in range(1, 4):
            assert post(http, path, body).status_code == 200
            assert len(checks) == n, checks
        assert early(http, "chat") == 1.0
        # a route the early hits do not watch is authenticated by the envelope alone
        assert http.get("/v1/models", headers={"authorization": "Bearer tok-a"}).status_code == 200
        assert len(checks) == 4


def test_the_memo_comes_from_the_core_not_the_headers(start: Start) -> None:
    """Under a sharing rule that hides hits, every answer's headers say MISS: the memo is
    still learned (the serving core tells the early hits), and the early answer says the
    same as the route would (MISS, no age), with a body made new."""
    fake = FakeGeneration()
    gw = start(TOKENS, fake)
    Path(gw.app.state.config.policy).write_text(POLICY + "[routes.chat]\nshared = true\n")
    admin = {"authorization": f"Bearer {ADMIN}"}
    path, body, _ = CASES["chat"]
    with httpx.Client(base_url=gw.url) as http:
        assert http.post("/admin/policy/reload", headers=admin).status_code == 200
        sent = [post(http, path, body) for _ in range(3)]
        assert {r.headers["cf-aig-cache-status"] for r in sent} == {"MISS"}
        assert early(http, "chat") == 1.0  # the third, taught by the second's hit
        assert len(fake.calls) == 1
        assert "age" not in sent[2].headers
        assert sent[2].headers["cache-status"] == sent[1].headers["cache-status"]
        assert sent[2].json()["id"] != sent[1].json()["id"]


def test_an_early_hits_age_and_lifetime_follow_the_clock(start: Start) -> None:
    """The early hits keep a hit's encoded headers while they say the same: as the clock
    moves, its age and lifetime move (the clock also runs for real: bounds, not values)."""
    gw = start(TOKENS + "[debug]\nadjustable_clock = true\n")
    path, body, route = CASES["chat"]
    with httpx.Client(base_url=gw.url) as http:
        answers = [post(http, path, body) for _ in range(3)]
        for advance in (0.2, 2, 61):
            moved = http.post(
                "/admin/debug/clock",
                json={"advance_s": advance},
                headers={"authorization": f"Bearer {ADMIN}"},
            )
            assert moved.status_code == 200, moved.text
            answers.append(post(http, path, body))
        assert early(http, route) == 4.0
    hits = answers[1:]
    assert len({r.headers["x-request-id"] for r in answers}) == len(answers)
    ages = [int(r.headers["age"]) for r in hits]
    assert ages == sorted(ages) and ages[-2] >= 2 and ages[-1] >= 63
    for r, age in zip(hits, ages, strict=True):
        lifetime = int(r.headers["cache-control"].removeprefix("private, max-age="))
        assert age + lifetime in (599, 600)  # ttl_s 600, both floored
        assert f"; ttl={lifetime};" in r.headers["cache-status"]
