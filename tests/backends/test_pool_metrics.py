"""What ``/metrics`` of the app ``semcache serve`` builds says about its vLLM servers: pools,
servers, P/D hops and the scraped vLLM counters (the servers' state set by hand, none runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import parse_upstream_metrics
from backends.vllm.client import VllmClient
from server.app import create_app
from server.config import GatewayConfig, ModelEntry

VLLM_PAGE = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 96.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 160.0
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 12.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 601.0
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:nixl_xfer_time_seconds Transfer time.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.015
# HELP vllm:generation_tokens_total Generation tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 5.0
"""


def _app(tmp_path: Path) -> Any:
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"]
    backend = VllmBackendConfig(
        name="tiny",
        served_model="tiny",
        revision="pinned",  # no start-up probe of these unreachable addresses
        max_inflight_per_server=4,
        servers=[
            VllmServer(url=urls[0], role="prefill"),
            VllmServer(url=urls[1], role="decode"),
            VllmServer(url=urls[2], role="decode"),
        ],
    )
    config = GatewayConfig(
        data_dir=str(tmp_path),
        cache=False,
        models=[ModelEntry(id="tiny-chat", backend="tiny")],
        backends=[backend],
    )
    return create_app(config)


def test_metrics_expose_servers_hops_and_scraped_vllm_counters(tmp_path: Path) -> None:
    app = _app(tmp_path)
    client: VllmClient = app.state.registry.generation["tiny"]
    pool = client.decode_pool
    a, b = pool.servers
    a.inflight, a.requests, a.errors["unreachable"] = 2, 10, 1
    pool.eject(b)
    a.upstream = parse_upstream_metrics(VLLM_PAGE)
    client.stats.hops["prefill"] += 3
    client.stats.prefill_skipped["short_prompt"] += 2
    client.stats.handoff_seconds.observe(0.02)
    client.stats.handoff_over_bound["stream"] += 1
    with TestClient(app) as http:
        page = http.get("/metrics").text
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    }

    def value(name: str, server: ServerState | None = None, **labels: str) -> float:
        if server is not None:
            labels |= {"backend": "tiny", "server": server.url, "role": server.role}
        else:
            labels |= {"backend": "tiny"}
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("semcache_backend_server_inflight", a) == 2
    assert value("semcache_backend_server_limit", a) == 4
    assert value("semcache_backend_server_requests_total", a) == 10
    assert value("semcache_backend_server_errors_total", a, kind="unreachable") == 1
    assert value("semcache_backend_server_healthy", a) == 1
    assert value("semcache_backend_server_healthy", b) == 0
    assert value("semcache_backend_server_ejections_total", b) == 1
    (prefill,) = client.prefill_pool.servers if client.prefill_pool else ()
    assert value("semcache_backend_server_healthy", prefill) == 1
    assert value("semcache_backend_queue_waiting", role="decode") == 0
    assert value("semcache_pd_hops_total", hop="prefill") == 3
    assert value("semcache_pd_prefill_skipped_total", reason="short_prompt") == 2
    assert value("semcache_pd_kv_handoff_seconds_count") == 1
    assert value("semcache_pd_kv_handoff_seconds_bucket", le="0.025") == 1
    assert value("semcache_pd_kv_handoff_seconds_bucket", le="0.01") == 0
    assert value("semcache_pd_handoff_over_bound_total", answer="stream") == 1
    assert value("semcache_pd_handoff_over_bound_total", answer="json") == 0
    assert value("semcache_upstream_vllm_prefix_cache_hits_total", a) == 96
    pool_labels = {"role": "decode"}
    hits = value("semcache_pool_prefix_cache_hits_total", **pool_labels)
    queries = value("semcache_pool_prefix_cache_queries_total", **pool_labels)
    assert (hits, queries) == (96, 160)  # the realised hit rate of the pool: 0.6
    tokens = "semcache_upstream_vllm_prompt_tokens_by_source_total"
    assert value(tokens, a, source="local_compute") == 12
    assert value(tokens, a, source="external_kv_transfer") == 601
    assert value("semcache_upstream_vllm_kv_cache_usage_perc", a) == 0.25
    assert value("semcache_upstream_vllm_nixl_xfer_time_seconds_sum", a) == 0.015
    assert value("semcache_upstream_vllm_nixl_xfer_time_seconds_count", a) == 1
    names = {name for name, _ in samples}
    assert not any("generation_tokens" in n for n in names)  # only prefix-cache/KV families
    assert not any(n.startswith("semcache_upstream") and n.endswith("_bucket") for n in names)
