"""The exact cache through the real gateway and a real vLLM: headers, replay, purge, tiers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import orjson
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME
from server.config import DebugSettings
from tests.conftest import gateway_config
from tests.semcache.conftest import RedisServer
from tests.support.configs import admin_auth, write_policy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"


def cache_policy(redis_url: str | None = None, extra: str = "") -> str:
    """Memory, disk and (when given) Redis tiers, prices, and embeddings shared."""
    redis = f'url = "{redis_url}"' if redis_url else ""
    return f"""
version = 1
[tiers.memory]
max_bytes = 16_000_000
[tiers.disk]
dir = "cache"
[tiers.redis]
{redis}
[defaults]
ttl_s = 600
swr_s = 60
[defaults.prices]
input_per_m = 0.045
output_per_m = 0.384
[routes.embeddings]
shared = true
reveal = ["status", "age", "saved", "semantic"]
{extra}
"""


def gateway_process(
    tmp: Path,
    data_dir: Path,
    vllm: VllmProcess,
    redis_url: str | None = None,
    *,
    adjustable_clock: bool = False,
    chat_only: bool = False,
) -> GatewayProcess:
    """``semcache serve`` on this module's policy, its cache tiers under ``tmp`` (not started).

    ``chat_only``: without the MiniLM embeddings, whose load is most of a start (~7 s of ~8).
    """
    policy = write_policy(tmp, cache_policy(redis_url))
    model = data_dir / "models" / TINY_MODEL_NAME
    config = gateway_config(tmp, vllm.url, model, policy=str(policy), auth=admin_auth(ADMIN))
    if adjustable_clock:
        config = msgspec.structs.replace(config, debug=DebugSettings(adjustable_clock=True))
    if chat_only:
        config = msgspec.structs.replace(
            config,
            models=[m for m in config.models if m.task == "chat"],
            backends=[b for b in config.backends if b.name == "tiny"],
        )
    return GatewayProcess(write_config_toml(config, tmp / "gateway.toml"))


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_vllm: VllmProcess
) -> Iterator[GatewayProcess]:
    """One ``semcache serve`` for the module's tests: each asks prompts of its own and reads
    counters as deltas, so none depends on another's entries. Two tests move the answer
    cache's clock (``[debug] adjustable_clock``, ``/admin/debug/clock``), only ever forward:
    that can only expire entries, which no other test relies on."""
    g = gateway_process(
        tmp_path_factory.mktemp("cache-http"), data_dir, tiny_vllm, adjustable_clock=True
    )
    try:
        yield g.start()
    finally:
        g.stop()


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }


def move_clock(gw: GatewayProcess, advance_s: float = 0.0, freeze: bool | None = None) -> None:
    """``POST /admin/debug/clock``: the time the gateway's answer cache reads (ages, TTLs,
    SWR windows)."""
    change: dict[str, Any] = {"advance_s": advance_s}
    if freeze is not None:
        change["freeze"] = freeze
    r = httpx.post(
        f"{gw.url}/admin/debug/clock", json=change, headers={"authorization": f"Bearer {ADMIN}"}
    )
    assert r.status_code == 200, r.text
    if freeze is not None:
        assert r.json()["frozen"] is freeze


@pytest.fixture
def frozen_clock(gw: GatewayProcess) -> Iterator[None]:
    """The shared gateway's clock held still for one test (which moves it with
    ``move_clock``), then let run on from where the test left it."""
    move_clock(gw, freeze=True)
    try:
        yield
    finally:
        move_clock(gw, freeze=False)


def backend_requests(vllm: VllmProcess) -> float:
    return parse_metric(httpx.get(f"{vllm.url}/metrics").text, "vllm:request_success_total")


def early_hits(gw: GatewayProcess) -> float:
    text = httpx.get(f"{gw.url}/metrics").text
    return parse_metric(text, "semcache_early_hits_total", {"route": "chat"})


def post(gw: GatewayProcess, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def sse_payloads(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(orjson.loads(line[6:]))
    return out


def test_hit_replays_the_same_answer_without_the_backend(
    gw: GatewayProcess, tiny_vllm: VllmProcess
) -> None:
    body = chat_body(f"hit test {random.random()}")
    first = post(gw, body)
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert "fwd=uri-miss" in first.headers["cache-status"]
    before = backend_requests(tiny_vllm)
    second = post(gw, body)
    assert second.headers["cf-aig-cache-status"] == "HIT"
    early_before = early_hits(gw)
    third = post(gw, body)  # the same bytes: answered before routing (server/envelope/early_hits)
    assert early_hits(gw) == early_before + 1
    assert third.content == second.content
    assert third.headers["x-semcache-key"] == second.headers["x-semcache-key"]
    assert second.headers["cache-status"].startswith("semcache; hit")
    assert int(second.headers["age"]) >= 0
    assert second.headers["x-semcache-key"] == first.headers["x-semcache-key"]
    assert second.content == first.content
    saved = int(second.headers["x-semcache-saved-tokens"])
    assert saved == first.json()["usage"]["total_tokens"]
    assert float(second.headers["x-semcache-saved-usd"]) > 0
    assert backend_requests(tiny_vllm) == before
    # equal-meaning body (key order, 1 vs 1.0, defaults spelled out) → same entry
    same = {**dict(reversed(list(body.items()))), "top_p": 1.0, "n": 1}
    assert post(gw, same).headers["cf-aig-cache-status"] == "HIT"
    assert post(gw, {**body, "max_tokens": 13}).headers["cf-aig-cache-status"] == "MISS"


def test_stream_and_json_replay_each_other(gw: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0)
    msgs: Any = [{"role": "user", "content": f"stream replay {random.random()}"}]
    live = list(
        client.chat.completions.create(
            model="tiny-chat", messages=msgs, max_tokens=10, temperature=0, stream=True
        )
    )
    assert all(c.usage is None for c in live)  # the client did not ask for usage
    text = "".join(c.choices[0].delta.content or "" for c in live if c.choices)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=msgs, max_tokens=10, temperature=0
    )
    assert raw.headers["cf-aig-cache-status"] == "HIT"
    as_json = raw.parse()
    assert as_json.choices[0].message.content == text
    assert as_json.usage is not None and as_json.usage.completion_tokens == 10
    replayed = list(
        client.chat.completions.create(
            model="tiny-chat",
            messages=msgs,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in replayed if c.choices) == text
    assert replayed[-1].usage is not None and replayed[-1].usage.completion_tokens == 10
    # and a JSON-populated entry replays as a stream
    msgs2: Any = [{"role": "user", "content": f"json first {random.random()}"}]
    plain = client.chat.completions.create(
        model="tiny-chat", messages=msgs2, max_tokens=10, temperature=0
    )
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={
            "model": "tiny-chat",
            "messages": msgs2,
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
        },
        headers={"authorization": "Bearer k"},  # the same tenant as the SDK client
    )
    assert r.headers["cf-aig-cache-status"] == "HIT"
    assert r.text.rstrip().endswith("data: [DONE]")
    chunks = sse_payloads(r.text)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == (
        plain.choices[0].message.content
    )


def test_sampled_requests_are_not_cached(gw: GatewayProcess) -> None:
    body = chat_body(f"sampled {random.random()}", temperature=0.9)
    assert post(gw, body).headers["cf-aig-cache-status"] == "BYPASS"  # policy: not cacheable
    assert post(gw, body).headers["cf-aig-cache-status"] == "BYPASS"
    seeded = chat_body(f"seeded {random.random()}", temperature=0.9, seed=3)
    post(gw, seeded)
    assert post(gw, seeded).headers["cf-aig-cache-status"] == "HIT"


@pytest.mark.usefixtures("frozen_clock")
def test_request_headers_control_the_cache(gw: GatewayProcess) -> None:
    body = chat_body(f"headers {random.random()}")
    assert post(gw, body, **{"cache-control": "no-store"}).headers["cf-aig-cache-status"] == "MISS"
    assert post(gw, body).headers["cf-aig-cache-status"] == "MISS"  # no-store stored nothing
    assert post(gw, body).headers["cf-aig-cache-status"] == "HIT"
    assert post(gw, body, **{"cache-control": "no-cache"}).headers["cf-aig-cache-status"] == (
        "BYPASS"
    )
    assert post(gw, body, **{"cf-aig-skip-cache": "true"}).headers["cf-aig-cache-status"] == (
        "BYPASS"
    )
    move_clock(gw, advance_s=1.1)
    assert post(gw, body, **{"cache-control": "max-age=0"}).headers["cf-aig-cache-status"] in (
        "EXPIRED",
        "MISS",
    )


@pytest.mark.usefixtures("frozen_clock")
def test_ttl_then_stale_while_revalidate(gw: GatewayProcess, tiny_vllm: VllmProcess) -> None:
    body = chat_body(f"swr {random.random()}")
    assert post(gw, body, **{"cf-aig-cache-ttl": "1"}).headers["cf-aig-cache-status"] == "MISS"
    move_clock(gw, advance_s=1.5)
    before = backend_requests(tiny_vllm)
    stale = post(gw, body)
    assert stale.headers["cf-aig-cache-status"] == "STALE"
    assert int(stale.headers["age"]) >= 1
    assert "ttl=-" in stale.headers["cache-status"]
    last: list[httpx.Response] = []

    def refreshed() -> bool:  # the background refresh stored its answer
        last[:] = [post(gw, body)]
        return last[0].headers["cf-aig-cache-status"] == "HIT"

    wait_until(refreshed, timeout_s=30, interval_s=0.2)
    r = last[0]
    assert int(r.headers["age"]) <= 1
    assert backend_requests(tiny_vllm) - before == 1


async def test_concurrent_identical_misses_make_one_backend_call(
    gw: GatewayProcess, tiny_vllm: VllmProcess
) -> None:
    body = chat_body(f"coalesce {random.random()}", max_tokens=40)
    before = backend_requests(tiny_vllm)
    async with httpx.AsyncClient(timeout=120) as client:
        rs = await asyncio.gather(
            *(client.post(f"{gw.url}/v1/chat/completions", json=body) for _ in range(50))
        )
    assert {r.status_code for r in rs} == {200}
    assert len({r.json()["choices"][0]["message"]["content"] for r in rs}) == 1
    assert backend_requests(tiny_vllm) - before == 1


def test_tenants_never_see_each_others_answers(gw: GatewayProcess) -> None:
    rng = random.Random(7)
    prompts = [f"tenant prompt {i} {random.random()}" for i in range(4)]
    tenants = [f"sk-tenant-{i}" for i in range(6)]
    seen: set[tuple[str, str]] = set()
    order = [(t, p) for t in tenants for p in prompts] * 2
    rng.shuffle(order)
    for tenant, prompt in order:
        r = post(gw, chat_body(prompt), authorization=f"Bearer {tenant}")
        status = r.headers["cf-aig-cache-status"]
        assert status == ("HIT" if (tenant, prompt) in seen else "MISS"), (tenant, prompt)
        seen.add((tenant, prompt))


def test_shared_route_hits_across_tenants(gw: GatewayProcess) -> None:
    body = {"model": "all-MiniLM-L6-v2", "input": f"shared {random.random()}"}
    a = httpx.post(f"{gw.url}/v1/embeddings", json=body, headers={"authorization": "Bearer a"})
    b = httpx.post(f"{gw.url}/v1/embeddings", json=body, headers={"authorization": "Bearer b"})
    assert a.headers["cf-aig-cache-status"] == "MISS"
    assert b.headers["cf-aig-cache-status"] == "HIT"
    assert a.json() == b.json()


def test_client_gone_mid_stream_stores_nothing(gw: GatewayProcess) -> None:
    # long enough that the gateway sees the client leave before the answer could be complete
    body = {
        **chat_body(f"gone {random.random()}", max_tokens=1500, stream=True),
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r,
    ):
        for _ in r.iter_raw():
            break
    # No wait: this request joins the abandoned stream's flight (and gets what it ends with),
    # reads what it stored, or, when nothing was, makes the whole answer itself. On a quiet
    # machine the tiny model can write all 1500 tokens before the gateway learns that the
    # client left; it then relayed (and may store) a complete answer. What must never be
    # stored or handed on is a partial one.
    answer = post(gw, {**body, "stream": False}).json()
    assert answer["usage"]["completion_tokens"] == 1500
    assert answer["choices"][0]["finish_reason"] == "length"


def test_admin_purge(gw: GatewayProcess) -> None:
    url = f"{gw.url}/admin/cache/purge"
    assert httpx.post(url, json={"kind": "all"}).status_code == 401
    denied = httpx.post(url, json={"kind": "all"}, headers={"authorization": "Bearer nope"})
    assert denied.status_code == 403
    assert set(denied.json()["error"]) == {"message", "type", "param", "code"}
    auth = {"authorization": f"Bearer {ADMIN}"}
    bad = httpx.post(url, json={"kind": "model"}, headers=auth)
    assert bad.status_code == 400
    not_a_key = httpx.post(url, json={"kind": "key", "target": "\u00e9t\u00e9"}, headers=auth)
    assert not_a_key.status_code == 400  # was a 500
    assert not_a_key.json()["error"]["param"] == "target"
    tagged = chat_body(f"purge tag {random.random()}")
    plain = chat_body(f"purge model {random.random()}")
    post(gw, tagged, **{"cf-aig-cache-key": "campaign-1"})
    post(gw, plain)
    assert (
        post(gw, tagged, **{"cf-aig-cache-key": "campaign-1"}).headers["cf-aig-cache-status"]
        == "HIT"
    )
    r = httpx.post(url, json={"kind": "tag", "target": "campaign-1"}, headers=auth)
    assert r.status_code == 200, r.text
    assert (
        post(gw, tagged, **{"cf-aig-cache-key": "campaign-1"}).headers["cf-aig-cache-status"]
        == "MISS"
    )
    assert post(gw, plain).headers["cf-aig-cache-status"] == "HIT"
    key = post(gw, plain).headers["x-semcache-key"]
    assert httpx.post(url, json={"kind": "key", "target": key}, headers=auth).status_code == 200
    assert post(gw, plain).headers["cf-aig-cache-status"] == "MISS"
    assert (
        httpx.post(url, json={"kind": "model", "target": "tiny-chat"}, headers=auth).status_code
        == 200
    )
    assert post(gw, plain).headers["cf-aig-cache-status"] == "MISS"


def test_metrics_count_hits_and_savings(gw: GatewayProcess) -> None:
    names = (
        "semcache_exact_hits_total",
        "semcache_exact_misses_total",
        "semcache_exact_tokens_saved_total",
        "semcache_exact_usd_saved_total",
    )

    def counts() -> list[float]:  # the shared gateway's counters: this test reads deltas
        text = httpx.get(f"{gw.url}/metrics").text
        return [parse_metric(text, name, {"model": "tiny-chat"}) for name in names]

    before = counts()
    body = chat_body(f"metrics {random.random()}")
    post(gw, body)
    post(gw, body)
    hits, misses, tokens_saved, usd_saved = (a - b for a, b in zip(counts(), before, strict=True))
    assert hits >= 1
    assert misses >= 1
    assert tokens_saved > 0
    assert usd_saved > 0


def test_two_gateways_share_redis_and_purge_reaches_both(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess, redis_server: RedisServer
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = gateway_process(tmp_path / "a", data_dir, tiny_vllm, redis_server.url, chat_only=True)
    b = gateway_process(tmp_path / "b", data_dir, tiny_vllm, redis_server.url, chat_only=True)
    try:
        a.start()
        b.start()
        body = chat_body(f"redis {random.random()}")
        assert post(a, body).headers["cf-aig-cache-status"] == "MISS"
        hit = post(b, body)
        assert hit.headers["cf-aig-cache-status"] == "HIT"  # from L3, written by a
        early = early_hits(b)
        assert post(b, body).headers["cf-aig-cache-status"] == "HIT"  # now also in b's L1
        assert early_hits(b) == early + 1  # answered before routing: a purge must reach it
        auth = {"authorization": f"Bearer {ADMIN}"}
        r = httpx.post(f"{a.url}/admin/cache/purge", json={"kind": "all"}, headers=auth)
        assert r.json()["propagated"] is True
        assert post(b, body).headers["cf-aig-cache-status"] == "MISS"  # no stale L1 in b
    finally:
        a.stop()
        b.stop()


def test_redis_down_keeps_serving(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess, redis_factory: Any
) -> None:
    redis = redis_factory()
    gw = gateway_process(tmp_path, data_dir, tiny_vllm, redis.url, chat_only=True)
    try:
        gw.start()
        body = chat_body(f"redis down {random.random()}")
        post(gw, body)
        redis.stop()
        r = post(gw, body)
        assert r.status_code == 200
        assert r.headers["cf-aig-cache-status"] == "HIT"  # from L1/L2
        fresh = post(gw, chat_body(f"redis down 2 {random.random()}"))
        assert fresh.status_code == 200
        redis.start()
    finally:
        gw.stop()
