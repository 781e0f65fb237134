"""Prometheus metrics of the exact cache, created on an injected registry (no globals)."""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from semcache.entry import CachedAnswer
from semcache.policy import Prices

M = TypeVar("M", Counter, Histogram)


class Labelled(Generic[M]):
    """A labelled metric whose children are kept in a dict.

    prometheus-client's ``labels()`` checks the values, builds its key and takes a lock on
    every call; the request path asks for several children per request. The
    children are the metric's own (they are exported as usual); none is ever removed.
    """

    __slots__ = ("_children", "metric")

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


LOOKUP_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5)


class CacheMetrics:
    """Counters by model and tier; ``prefix`` keeps exact and semantic caches apart."""

    def __init__(self, registry: CollectorRegistry, *, prefix: str = "semcache_exact") -> None:
        def counter(name: str, doc: str, labels: list[str]) -> Labelled[Counter]:
            return Labelled(Counter(f"{prefix}_{name}", doc, labels, registry=registry))

        self.hits = counter("hits", "Fresh answers served from the cache", ["model", "tier"])
        self.stale = counter(
            "stale_serves", "Stale answers served while refreshing (RFC 5861)", ["model", "tier"]
        )
        self.misses = counter("misses", "Lookups that found nothing", ["model"])
        self.expired = counter("expired", "Lookups that found only expired answers", ["model"])
        self.bypasses = counter(
            "bypasses", "Requests not looked up (policy, no-cache, skip-cache)", ["model"]
        )
        self.coalesced = counter(
            "coalesced", "Misses answered by another request's backend call", ["model"]
        )
        self.refreshes = counter(
            "refreshes", "Background refreshes of stale answers", ["model", "outcome"]
        )
        self.integrity_failures = counter(
            "integrity_failures", "Entries dropped because their checksum failed", ["tier"]
        )
        self.purged_reads = counter(
            "purged_reads", "Entries found but dropped because a purge covers them", ["tier"]
        )
        self.tier_errors = counter(
            "tier_errors", "Tier operations that failed (answered as a miss)", ["tier", "op"]
        )
        self.stores = counter("stores", "Answers stored", ["model"])
        self.bytes_stored = counter("stored_bytes", "Bytes written to a tier", ["tier"])
        self.bytes_served = counter(
            "served_bytes", "Answer bytes served from a tier", ["model", "tier"]
        )
        self.tokens_saved = counter(
            "tokens_saved", "Backend tokens saved by cache answers", ["model", "kind"]
        )
        self.usd_saved = counter(
            "usd_saved", "Backend cost saved by cache answers (USD, policy prices)", ["model"]
        )
        self.purges = counter("purges", "Purges by kind", ["kind"])
        self.lookup_seconds = Labelled(
            Histogram(
                f"{prefix}_lookup_seconds",
                "Time of an exact-cache lookup",
                ["status"],
                buckets=LOOKUP_BUCKETS,
                registry=registry,
            )
        )

    def served(
        self, model: str, tier: str, entry: CachedAnswer, prices: Prices, *, stale: bool
    ) -> None:
        """Count an answer served from ``tier`` and what it saved."""
        (self.stale if stale else self.hits).labels(model, tier).inc()
        self.bytes_served.labels(model, tier).inc(entry.payload_bytes)
        u = entry.usage
        if u.prompt_tokens:
            self.tokens_saved.labels(model, "prompt").inc(u.prompt_tokens)
        if u.completion_tokens:
            self.tokens_saved.labels(model, "completion").inc(u.completion_tokens)
        usd = prices.cost_usd(u.prompt_tokens, u.completion_tokens)
        if usd:
            self.usd_saved.labels(model).inc(usd)
