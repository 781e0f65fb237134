"""What the gateway exposes about its vLLM backends to Prometheus.

``BackendStats`` holds one backend's P/D counters and hop latencies; ``BackendCollector``
reads them, its pools (load, health, refusals, the signals of ``backends.fleet.pool_signals``)
and a copy of each server's own ``vllm:``
prefix-cache and KV counters (``backends.scraped_metrics``) at every scrape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from backends.fleet.kv.metrics import KvFamilies
from backends.fleet.kv.service import KvPlacement
from backends.fleet.pool import Pool
from backends.fleet.pool_signals import pool_signals
from backends.scraped_metrics import UpstreamSample

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_PREFILL_SECONDS = ("semcache_pd_prefill_seconds", "Duration of prefill hops.")
_HANDOFF_SECONDS = (
    "semcache_pd_kv_handoff_seconds",
    "From the prefill answer to the decode server's first byte (KV pull + first step).",
)


def _latency(name: str, documentation: str) -> Histogram:
    # Registered nowhere: BackendCollector exposes it with the backend's label.
    return Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=None)


def histogram_buckets(histogram: Histogram) -> tuple[list[tuple[str, float]], float]:
    """``(cumulative buckets as (le, count), sum)`` of an unlabelled histogram."""
    buckets: list[tuple[str, float]] = []
    total = 0.0
    (family,) = histogram.collect()
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            buckets.append((sample.labels["le"], sample.value))
        elif sample.name.endswith("_sum"):
            total = sample.value
    return buckets, total


def histogram_totals(histogram: Histogram) -> tuple[int, float]:
    """``(observations, their sum)`` of an unlabelled histogram."""
    buckets, total = histogram_buckets(histogram)
    return int(buckets[-1][1]), total


@dataclass(eq=False)
class BackendStats:
    """Everything ``BackendCollector`` exposes about one backend."""

    name: str
    pools: list[Pool]
    hops: Counter[str] = field(default_factory=Counter)
    """P/D hops: ``prefill``, ``decode``, ``decode_retry``."""
    prefill_skipped: Counter[str] = field(default_factory=Counter)
    """Why a request went to decode alone: ``short_prompt``, ``prefill_down``, ..."""
    prefill_seconds: Histogram = field(default_factory=lambda: _latency(*_PREFILL_SECONDS))
    handoff_seconds: Histogram = field(default_factory=lambda: _latency(*_HANDOFF_SECONDS))
    """From the prefill answer to the decode server's first byte: KV pull + first step."""
    kv: KvPlacement | None = None
    """KV placement's index, feeds and decisions (``placement = "kv"``)."""
    handoff_over_bound: Counter[str] = field(default_factory=Counter)
    """Hand-offs abandoned past ``handoff_bound_s`` (decode then computed the prompt alone),
    by answer shape: ``stream``, ``json``."""


class BackendCollector:
    """A Prometheus collector over the gateway's vLLM backends (anything with ``.stats``).

    The app factory registers one over ``registry.generation.values()``; the dict view is
    read at every scrape.
    """

    def __init__(self, backends: Iterable[object]) -> None:
        self.backends = backends

    def _stats(self) -> Iterator[BackendStats]:
        for backend in self.backends:
            stats = getattr(backend, "stats", None)
            if isinstance(stats, BackendStats):
                yield stats

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        server_labels = ["backend", "server", "role"]
        inflight = GaugeMetricFamily(
            "semcache_backend_server_inflight",
            "Requests open on a vLLM server.",
            labels=server_labels,
        )
        limit = GaugeMetricFamily(
            "semcache_backend_server_limit",
            "Concurrency limit of a vLLM server.",
            labels=server_labels,
        )
        healthy = GaugeMetricFamily(
            "semcache_backend_server_healthy", "1 while a server is admitted.", labels=server_labels
        )
        requests = CounterMetricFamily(
            "semcache_backend_server_requests", "Requests sent to a server.", labels=server_labels
        )
        errors = CounterMetricFamily(
            "semcache_backend_server_errors",
            "Failed requests by server and kind.",
            labels=[*server_labels, "kind"],
        )
        ejections = CounterMetricFamily(
            "semcache_backend_server_ejections", "Times a server was ejected.", labels=server_labels
        )
        waiting = GaugeMetricFamily(
            "semcache_backend_queue_waiting",
            "Requests waiting for a free server.",
            labels=["backend", "role"],
        )
        refused = CounterMetricFamily(
            "semcache_backend_refused",
            "Requests refused by a pool (overloaded → 429, unavailable → 503).",
            labels=["backend", "role", "kind"],
        )
        hops = CounterMetricFamily(
            "semcache_pd_hops", "Prefill/decode hops sent.", labels=["backend", "hop"]
        )
        skipped = CounterMetricFamily(
            "semcache_pd_prefill_skipped",
            "Requests decoded without a prefill hop, by reason.",
            labels=["backend", "reason"],
        )
        pools = PoolFamilies()
        prefill_s = HistogramMetricFamily(*_PREFILL_SECONDS, labels=["backend"])
        handoff_s = HistogramMetricFamily(*_HANDOFF_SECONDS, labels=["backend"])
        over_bound = CounterMetricFamily(
            "semcache_pd_handoff_over_bound",
            "KV hand-offs abandoned past the bound set inside the prefill's KV lease "
            "(the decode server then computed the prompt alone).",
            labels=["backend", "answer"],
        )
        upstream: dict[str, Metric] = {}
        kv = KvFamilies()
        queues = QueueFamilies()
        for stats in self._stats():
            if stats.kv is not None:
                kv.add(stats.name, stats.kv)
            for pool in stats.pools:
                waiting.add_metric([stats.name, pool.role], pool.admission.waiting)
                for kind, n in pool.admission.refused.items():
                    refused.add_metric([stats.name, pool.role, kind], n)
                pools.add(pool)
                queues.add(f"{stats.name}/{pool.role}", pool)
                for s in (*pool.servers, *pool.leaving()):
                    key = [stats.name, s.url, s.role]
                    inflight.add_metric(key, s.inflight)
                    limit.add_metric(key, s.limit)
                    healthy.add_metric(key, 1.0 if s.healthy else 0.0)
                    requests.add_metric(key, s.requests)
                    ejections.add_metric(key, s.ejections)
                    for kind, n in s.errors.items():
                        errors.add_metric([*key, kind], n)
                    for sample in s.upstream:
                        _add_upstream(upstream, sample, key)
            for hop, n in stats.hops.items():
                hops.add_metric([stats.name, hop], n)
            for reason, n in stats.prefill_skipped.items():
                skipped.add_metric([stats.name, reason], n)
            prefill_s.add_metric([stats.name], *histogram_buckets(stats.prefill_seconds))
            handoff_s.add_metric([stats.name], *histogram_buckets(stats.handoff_seconds))
            for answer in ("stream", "json"):
                over_bound.add_metric([stats.name, answer], stats.handoff_over_bound[answer])
        yield from (inflight, limit, healthy, requests, errors, ejections, waiting, refused)
        yield from (hops, skipped, prefill_s, handoff_s, over_bound)
        yield from pools.families()
        yield from queues.families()
        yield from kv.families()
        yield from upstream.values()


class PoolFamilies:
    """The ``semcache_pool_*`` families: each pool's signals (``backends.fleet.pool_signals``)."""

    def __init__(self) -> None:
        labels = ["backend", "role"]
        self.servers = GaugeMetricFamily(
            "semcache_pool_servers",
            "Servers of a pool by state (serving, ejected, draining).",
            labels=[*labels, "state"],
        )
        self.queue_depth = GaugeMetricFamily(
            "semcache_pool_queue_depth",
            "Requests waiting: in the gateway's admission queue plus inside the vLLM servers.",
            labels=labels,
        )
        self.inflight = GaugeMetricFamily(
            "semcache_pool_inflight", "Requests open on the pool's servers.", labels=labels
        )
        self.limit = GaugeMetricFamily(
            "semcache_pool_limit", "Sum of the serving servers' concurrency limits.", labels=labels
        )
        self.kv_usage = GaugeMetricFamily(
            "semcache_pool_kv_cache_usage",
            "Mean KV-cache usage (0..1) of the pool's serving servers, as last scraped.",
            labels=labels,
        )
        self.kv_usage_max = GaugeMetricFamily(
            "semcache_pool_kv_cache_usage_max",
            "Highest KV-cache usage (0..1) of one serving server, as last scraped.",
            labels=labels,
        )
        self.queue_time = SummaryMetricFamily(
            "semcache_pool_queue_time_seconds",
            "Time requests waited inside the pool's vLLM servers (summed over the servers).",
            labels=labels,
        )
        self.ttft = SummaryMetricFamily(
            "semcache_pool_ttft_seconds",
            "Time to first token of the pool's vLLM servers (summed over the servers).",
            labels=labels,
        )
        self.prefix_hits = CounterMetricFamily(
            "semcache_pool_prefix_cache_hits",
            "Prompt tokens the pool's vLLM servers found in their prefix cache (their own "
            "counter, summed; the realised hit rate: over semcache_pool_prefix_cache_queries).",
            labels=labels,
        )
        self.prefix_queries = CounterMetricFamily(
            "semcache_pool_prefix_cache_queries",
            "Prompt tokens the pool's vLLM servers looked up in their prefix cache (summed).",
            labels=labels,
        )

    def add(self, pool: Pool) -> None:
        sig = pool_signals(pool)
        key = [sig.backend, sig.role]
        for state, n in (
            ("serving", sig.serving),
            ("ejected", sig.ejected),
            ("draining", sig.draining),
        ):
            self.servers.add_metric([*key, state], n)
        self.queue_depth.add_metric(key, sig.queue_depth)
        self.inflight.add_metric(key, sig.inflight)
        self.limit.add_metric(key, sig.limit)
        if sig.kv_cache_usage is not None and sig.kv_cache_usage_max is not None:
            self.kv_usage.add_metric(key, sig.kv_cache_usage)
            self.kv_usage_max.add_metric(key, sig.kv_cache_usage_max)
        self.queue_time.add_metric(key, int(sig.queue_time.count), sig.queue_time.sum)
        self.ttft.add_metric(key, int(sig.ttft.count), sig.ttft.sum)
        self.prefix_hits.add_metric(key, sig.prefix_cache_hits)
        self.prefix_queries.add_metric(key, sig.prefix_cache_queries)

    def families(self) -> list[Metric]:
        return [
            self.servers,
            self.queue_depth,
            self.inflight,
            self.limit,
            self.kv_usage,
            self.kv_usage_max,
            self.queue_time,
            self.ttft,
            self.prefix_hits,
            self.prefix_queries,
        ]


def _add_upstream(families: dict[str, Metric], sample: UpstreamSample, key: list[str]) -> None:
    """Re-expose a scraped ``vllm:x`` sample as ``semcache_upstream_vllm_x`` with our labels."""
    name = "semcache_upstream_" + sample.name.replace(":", "_")
    extra = [k for k, _ in sample.labels]
    family = families.get(name)
    if family is None:
        labels = ["backend", "server", "role", *extra]
        doc = f"{sample.name} as last scraped from each vLLM server."
        if sample.counter and name.endswith("_total"):
            family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
        else:
            family = GaugeMetricFamily(name, doc, labels=labels)
        families[name] = family
    family.add_metric([*key, *(v for _, v in sample.labels)], sample.value)  # type: ignore[attr-defined]


class QueueFamilies:
    """The ``semcache_queue_*`` families: each pool's fair wait queue
    (``backends.fleet.fair_queue``); ``pool`` is ``backend/role``."""

    def __init__(self) -> None:
        self.depth = GaugeMetricFamily(
            "semcache_queue_depth",
            "Requests waiting for a slot in a pool, by band and tenant.",
            labels=["pool", "band", "tenant"],
        )
        self.wait = HistogramMetricFamily(
            "semcache_queue_wait_seconds",
            "How long requests that queued waited for a slot (or until refused), by band.",
            labels=["pool", "band"],
        )
        self.held = GaugeMetricFamily(
            "semcache_queue_held",
            "Slots of a pool each flow holds now, by band and tenant (while other flows are "
            "active, a flow holds at most its share: [queue] share_window_s).",
            labels=["pool", "band", "tenant"],
        )
        self.rejected = CounterMetricFamily(
            "semcache_queue_rejected",
            "Requests a pool's queue refused with a 429, by band, tenant and reason "
            "(queue_full, tenant_queue_full, wait).",
            labels=["pool", "band", "tenant", "reason"],
        )

    def add(self, name: str, pool: Pool) -> None:
        admission = pool.admission
        for (band, tenant), n in admission.queue.depth.items():
            self.depth.add_metric([name, band, tenant], n)
        for (band, tenant), n in admission.holding.items():
            self.held.add_metric([name, band, tenant], n)
        for waited, histogram in admission.waits.items():
            self.wait.add_metric([name, waited], *histogram_buckets(histogram))
        for (refused, who, reason), n in admission.rejected.items():
            self.rejected.add_metric([name, refused, who, reason], n)

    def families(self) -> Iterator[Metric]:
        yield from (self.depth, self.held, self.wait, self.rejected)
