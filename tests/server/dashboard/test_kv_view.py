"""The Backends page's KV placement rows: predicted and realised prefix-cache hit rate,
decisions by reason and index size, read from the same registry as ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from backends.config import VllmBackendConfig
from backends.fleet.kv.metrics import KvFamilies
from backends.fleet.kv.service import KvPlacement
from backends.fleet.placement import Placement, RouteKey
from backends.fleet.server_state import ServerState
from server.dashboard import figures as fig
from server.dashboard.formats import template_config

URLS = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")


def kv_backend() -> VllmBackendConfig:
    servers = [
        {"url": url, "kv_events": f"tcp://127.0.0.1:{5601 + i}"} for i, url in enumerate(URLS)
    ]
    return msgspec.convert(
        {"name": "m", "served_model": "m", "placement": "kv", "servers": servers}, VllmBackendConfig
    )


class Families:
    """What the backend collector exposes for one KV backend, plus vLLM's own counters."""

    def __init__(self, kv: KvPlacement, hits: dict[str, tuple[float, float]]) -> None:
        self.kv = kv
        self.hits = hits

    def collect(self) -> Iterator[Metric]:
        families = KvFamilies()
        families.add("m", self.kv)
        yield from families.families()
        queries = CounterMetricFamily(
            "semcache_upstream_vllm_prefix_cache_queries", "", labels=["backend", "server", "role"]
        )
        hits = CounterMetricFamily(
            "semcache_upstream_vllm_prefix_cache_hits", "", labels=["backend", "server", "role"]
        )
        for url, (asked, held) in self.hits.items():
            queries.add_metric(["m", url, "both"], asked)
            hits.add_metric(["m", url, "both"], held)
        yield queries
        yield hits


def test_the_kv_rows_show_predicted_and_realised_hit_rates_reasons_and_index_size() -> None:
    config = kv_backend()
    kv = KvPlacement(config)
    servers = [ServerState(s, limit=8) for s in config.servers]
    kv.index.store(servers[0].url, [11, 12, 13])
    kv.index.store(servers[1].url, [21])
    placement = Placement(2, "kv", kv.scorer)
    # 4 blocks of 32: the first server holds 3 of them
    assert (
        placement.rank(
            servers, RouteKey(blocks=(11, 12, 13, 14), block_size=32, prompt_tokens=128)
        )[0]
        is servers[0]
    )
    # nobody holds block 99: least loaded, fewest blocks
    placement.rank(servers, RouteKey(blocks=(99,), block_size=32, prompt_tokens=32))
    placement.rank(servers, RouteKey(prefix="p"))  # no exact blocks: the hash decides
    registry = CollectorRegistry()
    registry.register(Families(kv, {URLS[0]: (160.0, 96.0), URLS[1]: (40.0, 0.0)}))
    (row,) = fig.kv_placement(fig.read_samples(registry))
    assert row["backend"] == "m" and row["role"] == "both"
    assert row["predicted_hit_rate"] == 96 / 160
    assert row["realised_hit_rate"] == 96 / 200
    assert row["decisions"] == {"cache": 1, "no_match": 1, "fallback": 1}
    assert row["index_blocks"] == 4
    assert row["index_evicted"] == 0
    html = render_backends({"servers": [], "pools": [], "kv": [row], "semantic_loaded": False})
    assert "60.0 %" in html and "48.0 %" in html and "cache 1, no_match 1, fallback 1" in html


def render_backends(data: dict[str, object]) -> str:
    """The Backends page's template with the dashboard's own filters."""
    engine = template_config().to_engine()
    template = engine.get_template("backends.html")
    return template.render(data=data, page="backends", pages=(), request=None)


class PdFamilies:
    """A P/D backend's hop and skip counters, as the backend collector exposes them."""

    def collect(self) -> Iterator[Metric]:
        hops = CounterMetricFamily("semcache_pd_hops", "", labels=["backend", "hop"])
        hops.add_metric(["m", "prefill"], 3)
        skipped = CounterMetricFamily(
            "semcache_pd_prefill_skipped", "", labels=["backend", "reason"]
        )
        skipped.add_metric(["m", "cached_on_decode"], 5)
        skipped.add_metric(["m", "short_prompt"], 1)
        yield hops
        yield skipped


def test_the_pools_rows_show_the_prefills_skipped_by_reason() -> None:
    registry = CollectorRegistry()
    registry.register(PdFamilies())
    (row,) = fig.backend_pools(fig.read_samples(registry))
    assert row["hops"] == {"prefill": 3}
    assert row["skipped"] == {"cached_on_decode": 5, "short_prompt": 1}
    html = render_backends({"servers": [], "pools": [row], "kv": [], "semantic_loaded": False})
    assert "cached_on_decode 5, short_prompt 1" in html


def test_a_hot_prefix_spread_shows_among_the_reasons() -> None:
    config = kv_backend()
    kv = KvPlacement(config)
    servers = [ServerState(s, limit=8) for s in config.servers]
    kv.index.store(servers[0].url, [11, 12])
    servers[0].pending_tokens = 10_000  # its backlog: computing the prompt elsewhere is cheaper
    placement = Placement(2, "kv", kv.scorer)
    key = RouteKey(blocks=(11, 12), block_size=32, prompt_tokens=64)
    assert placement.rank(servers, key)[0] is servers[1]
    registry = CollectorRegistry()
    registry.register(Families(kv, {}))
    (row,) = fig.kv_placement(fig.read_samples(registry))
    assert row["decisions"] == {"spread": 1}


def test_no_kv_backend_gives_no_rows() -> None:
    assert fig.kv_placement(fig.read_samples(CollectorRegistry())) == []
