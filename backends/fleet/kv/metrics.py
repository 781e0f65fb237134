"""KV placement's ``/metrics`` families: index size, feed health, decisions by reason, and the
prefix-cache hit rate placement predicted (the realised one is vLLM's own
``semcache_upstream_vllm_prefix_cache_hits`` / ``_queries``, copied per server)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.fleet.kv.service import KvPlacement


class KvFamilies:
    """The ``semcache_kv_*`` families, filled backend by backend at a scrape."""

    def __init__(self) -> None:
        server = ["backend", "server"]
        self.blocks = GaugeMetricFamily(
            "semcache_kv_index_blocks", "KV blocks indexed per server.", labels=server
        )
        self.evicted = CounterMetricFamily(
            "semcache_kv_index_evicted",
            "Index entries dropped because a server reached max_blocks_per_server.",
            labels=server,
        )
        self.feed = CounterMetricFamily(
            "semcache_kv_events",
            "KV event feed: batches applied, gaps, replays, rebuilds, bad messages.",
            labels=[*server, "kind"],
        )
        self.hash_checks = CounterMetricFamily(
            "semcache_kv_hash_checks",
            "Stored blocks recomputed by the gateway: match or mismatch (then: fallback).",
            labels=["backend", "result"],
        )
        self.decisions = CounterMetricFamily(
            "semcache_kv_placement_decisions",
            "KV placement decisions by pool role and reason.",
            labels=["backend", "role", "reason"],
        )
        self.predicted = CounterMetricFamily(
            "semcache_kv_predicted_cached_tokens",
            "Prompt tokens the chosen server was predicted to hold (hit rate: over "
            "semcache_kv_ranked_prompt_tokens).",
            labels=["backend", "role"],
        )
        self.ranked = CounterMetricFamily(
            "semcache_kv_ranked_prompt_tokens",
            "Prompt tokens of the requests KV placement ranked.",
            labels=["backend", "role"],
        )

    def add(self, backend: str, kv: KvPlacement) -> None:
        stats = kv.feeds.stats
        for server in kv.feeds.feeds:
            key = [backend, server]
            self.blocks.add_metric(key, kv.index.size(server))
            self.evicted.add_metric(key, kv.index.evicted[server])
            for kind, counter in (
                ("batches", stats.batches),
                ("gaps", stats.gaps),
                ("replays", stats.replays),
                ("rebuilds", stats.rebuilds),
                ("bad_messages", stats.bad_messages),
            ):
                self.feed.add_metric([*key, kind], counter[server])
        for result, n in stats.hash_checks.items():
            self.hash_checks.add_metric([backend, result], n)
        decisions = kv.scorer.decisions
        for (role, reason), n in decisions.reasons.items():
            self.decisions.add_metric([backend, role, reason], n)
        for role, n in decisions.prompt_tokens.items():
            self.ranked.add_metric([backend, role], n)
            self.predicted.add_metric([backend, role], decisions.predicted_tokens[role])

    def families(self) -> list[Metric]:
        return [
            self.blocks,
            self.evicted,
            self.feed,
            self.hash_checks,
            self.decisions,
            self.predicted,
            self.ranked,
        ]
