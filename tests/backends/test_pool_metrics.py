"""What BackendCollector exposes: pools, servers, P/D hops and the scraped vLLM counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.pool_metrics import BackendCollector, BackendStats
from backends.scraped_metrics import parse_upstream_metrics
from backends.servers import ServerState
from tests.backends.pools import make_pool

VLLM_PAGE = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 96.0
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


class _Backend:
    def __init__(self, stats: BackendStats) -> None:
        self.stats = stats


def test_collector_exposes_servers_hops_and_scraped_vllm_counters() -> None:
    pool = make_pool([4, 4])
    a, b = pool.servers
    a.inflight, a.requests, a.errors["unreachable"] = 2, 10, 1
    pool.eject(b)
    a.upstream = parse_upstream_metrics(VLLM_PAGE)
    stats = BackendStats("tiny", [pool])
    stats.hops["prefill"] += 3
    stats.prefill_skipped["short_prompt"] += 2
    stats.handoff_seconds.observe(0.02)
    registry = CollectorRegistry()
    registry.register(BackendCollector([_Backend(stats), object()]))
    page = generate_latest(registry).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    }

    def value(name: str, server: ServerState | None = None, **labels: str) -> float:
        if server is not None:
            labels |= {"backend": "tiny", "server": server.url, "role": "decode"}
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
    assert value("semcache_pd_hops_total", hop="prefill") == 3
    assert value("semcache_pd_prefill_skipped_total", reason="short_prompt") == 2
    assert value("semcache_pd_kv_handoff_seconds_count") == 1
    assert value("semcache_pd_kv_handoff_seconds_bucket", le="0.025") == 1
    assert value("semcache_pd_kv_handoff_seconds_bucket", le="0.01") == 0
    assert value("semcache_upstream_vllm_prefix_cache_hits_total", a) == 96
    tokens = "semcache_upstream_vllm_prompt_tokens_by_source_total"
    assert value(tokens, a, source="local_compute") == 12
    assert value(tokens, a, source="external_kv_transfer") == 601
    assert value("semcache_upstream_vllm_kv_cache_usage_perc", a) == 0.25
    assert value("semcache_upstream_vllm_nixl_xfer_time_seconds_sum", a) == 0.015
    assert value("semcache_upstream_vllm_nixl_xfer_time_seconds_count", a) == 1
    names = {name for name, _ in samples}
    assert not any("generation_tokens" in n for n in names)  # only prefix-cache/KV families
    assert not any(n.startswith("semcache_upstream") and n.endswith("_bucket") for n in names)
