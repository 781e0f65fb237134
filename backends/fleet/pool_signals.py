"""The signals that say a pool is short of servers, from the gateway's own counts and the
vLLM metrics its health checks scrape (``backends.scraped_metrics``).

- queue depth: requests waiting for a slot in the gateway's admission queue plus those waiting
  inside the servers (``vllm:num_requests_waiting``);
- queue time and time to first token: vLLM's histograms, summed over the pool's servers
  (cumulative ``sum``/``count`` for Prometheus, and the mean over the last scrape interval);
- KV cache usage: mean and max of ``vllm:kv_cache_usage_perc`` over the servers;
- the realised prefix-cache hit rate: vLLM's own prefix-cache hits and queries (tokens),
  summed over the pool's servers (placement's effect, as vLLM counts it).

The ``recent_*`` means compare each server's last two scrapes (one health interval apart):
``None`` when no request finished in between.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from backends.fleet.pool import Pool
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import UpstreamSample

QUEUE_TIME = "vllm:request_queue_time_seconds"
TTFT = "vllm:time_to_first_token_seconds"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


class Histogram(msgspec.Struct):
    """A histogram's cumulative ``sum`` and ``count`` over the pool's servers (it goes down
    when one leaves: Prometheus' ``rate`` reads that as a counter reset)."""

    sum: float = 0.0
    count: float = 0.0


class PoolSignals(msgspec.Struct):
    """One pool's load and its shortage signals (the admin API's and ``/metrics``' view)."""

    backend: str
    role: str
    serving: int
    """Admitted servers."""
    ejected: int
    draining: int
    inflight: int
    """Requests the gateway has open on the pool's servers."""
    limit: int
    """The sum of the admitted servers' concurrency limits."""
    gateway_waiting: int
    """Requests waiting in the gateway's admission queue of the pool."""
    vllm_waiting: float
    vllm_running: float
    queue_depth: float
    """``gateway_waiting + vllm_waiting``."""
    kv_cache_usage: float | None
    """Mean over the servers scraped (0..1)."""
    kv_cache_usage_max: float | None
    queue_time: Histogram
    ttft: Histogram
    prefix_cache_hits: float
    """Prompt tokens the pool's servers found in their prefix cache (vLLM's counter)."""
    prefix_cache_queries: float
    """Prompt tokens they looked up."""
    recent_queue_time_s: float | None
    recent_ttft_s: float | None


def _total(samples: Iterable[UpstreamSample], name: str) -> float | None:
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None


def _histogram(servers: Sequence[ServerState], family: str) -> Histogram:
    out = Histogram()
    for s in servers:
        out.sum += _total(s.upstream, f"{family}_sum") or 0.0
        out.count += _total(s.upstream, f"{family}_count") or 0.0
    return out


def _recent_mean(servers: Sequence[ServerState], family: str) -> float | None:
    """Mean of the observations made between each server's last two scrapes."""
    total = count = 0.0
    for s in servers:
        if not s.previous_upstream:
            continue
        pairs = [(s.upstream, 1.0), (s.previous_upstream, -1.0)]
        for samples, sign in pairs:
            total += sign * (_total(samples, f"{family}_sum") or 0.0)
            count += sign * (_total(samples, f"{family}_count") or 0.0)
    return total / count if count > 0 else None


def pool_signals(pool: Pool) -> PoolSignals:
    """Read ``pool`` now (a few list walks: for scrapes and admin calls, not requests)."""
    serving = [s for s in pool.servers if s.healthy]
    usage = [
        u for s in serving if (u := _total(s.upstream, "vllm:kv_cache_usage_perc")) is not None
    ]
    vllm_waiting = sum(_total(s.upstream, "vllm:num_requests_waiting") or 0.0 for s in serving)
    leaving = pool.leaving()
    return PoolSignals(
        backend=pool.backend,
        role=pool.role,
        serving=len(serving),
        ejected=len(pool.servers) - len(serving),
        draining=len(leaving),
        inflight=sum(s.inflight for s in (*pool.servers, *leaving)),
        limit=sum(s.limit for s in serving),
        gateway_waiting=pool.admission.waiting,
        vllm_waiting=vllm_waiting,
        vllm_running=sum(_total(s.upstream, "vllm:num_requests_running") or 0.0 for s in serving),
        queue_depth=pool.admission.waiting + vllm_waiting,
        kv_cache_usage=sum(usage) / len(usage) if usage else None,
        kv_cache_usage_max=max(usage) if usage else None,
        queue_time=_histogram(pool.servers, QUEUE_TIME),
        ttft=_histogram(pool.servers, TTFT),
        prefix_cache_hits=sum(_total(s.upstream, PREFIX_HITS) or 0.0 for s in pool.servers),
        prefix_cache_queries=sum(_total(s.upstream, PREFIX_QUERIES) or 0.0 for s in pool.servers),
        recent_queue_time_s=_recent_mean(serving, QUEUE_TIME),
        recent_ttft_s=_recent_mean(serving, TTFT),
    )
