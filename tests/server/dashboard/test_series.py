"""The dashboard's counter series: rates and quantiles per step, bounded rings (a test clock)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from semcache.metrics import CacheMetrics
from server.dashboard.figures import quantile
from server.dashboard.series import WINDOWS, CounterSeries
from server.metrics import GatewayMetrics
from tests.support.stepped_clock import SteppedClock


def test_each_step_is_the_difference_of_two_samples() -> None:
    registry = CollectorRegistry()
    metrics, cache = GatewayMetrics(registry), CacheMetrics(registry)
    clock = SteppedClock(1000.0)
    series = CounterSeries(registry, clock)
    series.sample()
    for _ in range(10):
        metrics.requests.labels("/v1/chat/completions", "m", "200").inc()
        metrics.latency.labels("chat", "false").observe(0.2)
    metrics.requests.labels("/v1/chat/completions", "m", "404").inc()
    cache.hits.labels("m", "memory").inc(30)  # item lookups: not what the rates count
    cache.misses.labels("m").inc(70)
    route = "/v1/chat/completions"
    metrics.cache_outcomes.labels(route, "m", "exact").inc(2)
    metrics.cache_outcomes.labels(route, "m", "stale").inc(1)
    metrics.cache_outcomes.labels(route, "m", "semantic").inc(2)
    metrics.cache_outcomes.labels(route, "m", "partial").inc(1)
    metrics.cache_outcomes.labels(route, "m", "miss").inc(4)
    metrics.cache_outcomes.labels(route, "m", "bypass").inc(5)  # not a lookup
    clock.now += 5
    series.sample()
    chart = series.chart("5m")
    assert chart["time"] == [1005.0]
    assert chart["requests_per_s"] == [11 / 5]
    assert chart["exact_hit_rate"] == [0.3] and chart["semantic_hit_rate"] == [0.2]
    assert chart["errors_4xx"] == [1] and chart["errors_5xx"] == [0]
    (p50,) = chart["latency_p50_s"]
    assert p50 is not None and 0.1 < p50 <= 0.25  # inside the 0.1-0.25 s bucket
    assert chart["ttft_p50_s"] == [None]  # nothing streamed
    assert series.chart("1h")["time"] == []  # an hour's step has not passed yet


def test_rings_stay_bounded() -> None:
    clock = SteppedClock(1000.0)
    series = CounterSeries(CollectorRegistry(), clock)
    for _ in range(1000):
        series.sample()
        clock.now += 5
    assert len(series.chart("5m")["time"]) == WINDOWS["5m"].points
    assert len(series.rings["1h"]) <= WINDOWS["1h"].points + 1


def test_quantile_interpolates_inside_its_bucket_as_prometheus_does() -> None:
    buckets = {"0.1": 0.0, "0.2": 10.0, "+Inf": 10.0}
    assert quantile(buckets, 0.5) == pytest.approx(0.15)
    assert quantile({"0.1": 0.0, "+Inf": 0.0}, 0.5) is None
    assert quantile({"0.1": 0.0, "+Inf": 4.0}, 0.99) == 0.1  # past the last finite bucket
