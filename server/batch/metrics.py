"""The Prometheus metrics of the batch workers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.items = Counter(
            "semcache_batch_items",
            "Batch items finished, by outcome (success, failure, duplicate).",
            ["outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "semcache_batch_retries",
            "Batch items given back after a backend failure.",
            registry=registry,
        )
        self.preemptions = Counter(
            "semcache_batch_preemptions",
            "Batch items stopped (and queued again) because a live request arrived.",
            registry=registry,
        )
        self.unserved = Counter(
            "semcache_batch_unserved",
            "Batch items given back because this gateway does not serve their model.",
            registry=registry,
        )
        self.running = Gauge(
            "semcache_batch_running", "Batch items this gateway runs now.", registry=registry
        )
