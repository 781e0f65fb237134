"""Pools without vLLM: per-server limits, the bounded wait queue, ejection, metrics."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.config import VllmBackend, VllmServer
from backends.pool import (
    BackendCollector,
    BackendStats,
    HealthMonitor,
    Pool,
    ServerState,
    build_pools,
    parse_upstream_metrics,
)
from backends.protocol import BackendError
from backends.upstream import HttpSession
from tests.support.fake_upstream import FakeServer


def make_pool(
    limits: list[int],
    *,
    max_queue: int = 2,
    timeout_s: float = 5.0,
    urls: list[str] | None = None,
) -> Pool:
    urls = urls or [f"http://127.0.0.1:{9000 + i}" for i in range(len(limits))]
    states = [
        ServerState(VllmServer(url=url, role="decode"), limit=n)
        for url, n in zip(urls, limits, strict=True)
    ]
    return Pool(
        "b",
        "decode",
        states,
        max_queue=max_queue,
        queue_timeout_s=timeout_s,
        retry_after_s=2,
        unavailable_retry_after_s=5,
    )


async def test_a_server_takes_at_most_its_limit_then_the_next_one() -> None:
    pool = make_pool([2, 1])
    a, b = pool.servers
    leases = [await pool.acquire(lambda: [a, b]) for _ in range(3)]
    assert [lease.server for lease in leases] == [a, a, b]
    assert (a.inflight, b.inflight) == (2, 1)
    assert not pool.has_capacity()
    leases[0].release()
    leases[0].release()  # idempotent
    assert a.inflight == 1 and pool.has_capacity()
    assert not pool.has_capacity(per_server_limit=1)  # a runs 1, b runs 1


async def test_a_full_pool_queues_then_refuses_with_retry_after() -> None:
    pool = make_pool([1], max_queue=2)
    (server,) = pool.servers
    held = await pool.acquire(lambda: [server])
    waiters = [asyncio.create_task(pool.acquire(lambda: [server])) for _ in range(2)]
    await asyncio.sleep(0)
    assert pool.waiting == 2
    with pytest.raises(BackendError) as refused:
        await pool.acquire(lambda: [server])
    assert refused.value.kind == "overloaded"
    assert refused.value.retry_after_s == 2
    held.release()
    first = await asyncio.wait_for(waiters[0], 1)  # FIFO: the first waiter goes first
    assert not waiters[1].done()
    first.release()
    second = await asyncio.wait_for(waiters[1], 1)
    second.release()
    assert server.inflight == 0 and pool.waiting == 0
    assert pool.refused["overloaded"] == 1


async def test_a_wait_longer_than_the_queue_timeout_is_refused() -> None:
    pool = make_pool([1], max_queue=4, timeout_s=0.05)
    (server,) = pool.servers
    held = await pool.acquire(lambda: [server])
    with pytest.raises(BackendError) as refused:
        await pool.acquire(lambda: [server])
    assert refused.value.kind == "overloaded"
    assert pool.waiting == 0
    held.release()
    (await pool.acquire(lambda: [server])).release()  # the slot was not lost


async def test_a_cancelled_waiter_leaves_the_queue_and_passes_its_turn() -> None:
    pool = make_pool([1], max_queue=4)
    (server,) = pool.servers
    held = await pool.acquire(lambda: [server])
    cancelled = asyncio.create_task(pool.acquire(lambda: [server]))
    patient = asyncio.create_task(pool.acquire(lambda: [server]))
    await asyncio.sleep(0)
    cancelled.cancel()
    held.release()
    lease = await asyncio.wait_for(patient, 1)
    assert lease.server is server and pool.waiting == 0
    lease.release()


async def test_no_healthy_server_is_unavailable_and_ejection_wakes_waiters() -> None:
    pool = make_pool([1, 1], max_queue=4)
    a, b = pool.servers
    leases = [await pool.acquire(lambda: pool.healthy()) for _ in range(2)]
    waiter = asyncio.create_task(pool.acquire(lambda: pool.healthy()))
    await asyncio.sleep(0)
    pool.eject(a)
    pool.eject(b)
    with pytest.raises(BackendError) as down:
        await asyncio.wait_for(waiter, 1)
    assert down.value.kind == "unavailable"
    assert down.value.retry_after_s == 5
    with pytest.raises(BackendError):
        await pool.acquire(lambda: pool.healthy())
    assert (a.ejections, b.ejections) == (1, 1)
    for lease in leases:
        lease.release()
    pool.readmit(b)
    assert (await pool.acquire(lambda: pool.healthy())).server is b


def test_build_pools_by_role() -> None:
    pd = VllmBackend(
        name="m",
        served_model="m",
        max_inflight_per_server=7,
        servers=[
            VllmServer(url="http://h:1", role="prefill"),
            VllmServer(url="http://h:2", role="decode", max_inflight=3),
            VllmServer(url="http://h:3", role="decode"),
        ],
    )
    prefill, decode = build_pools(pd)
    assert prefill is not None and prefill.role == "prefill"
    assert [s.limit for s in decode.servers] == [3, 7]
    mono_prefill, mono = build_pools(
        VllmBackend(name="m", served_model="m", servers=[VllmServer(url="http://h:1")])
    )
    assert mono_prefill is None and mono.role == "both"


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


async def test_health_checks_eject_after_three_silent_failures_and_readmit() -> None:
    slow = {"a": False}

    async def health_a(request: web.Request) -> web.StreamResponse:
        if slow["a"]:
            await asyncio.Event().wait()  # never answers: the check times out
        return web.Response(status=200)

    async def health_b(request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    server_a, server_b = FakeServer(health_a), FakeServer(health_b)
    await server_a.start()
    await server_b.start()
    pool = make_pool([4, 4], urls=[server_a.url, server_b.url])
    a, b = pool.servers
    http = HttpSession(max_connections=8, read_timeout_s=60, connect_timeout_s=5)
    try:
        monitor = HealthMonitor(http, [pool], interval_s=60, timeout_s=0.2, scrape_metrics=False)
        slow["a"] = True  # answers /health too late: busy, or stuck
        for _ in range(2):
            await monitor.check_all()
        pool.answered(a)  # ...but it just relayed an answer: busy, not dead
        for _ in range(2):
            await monitor.check_all()
        assert a.healthy
        await monitor.check_all()
        assert not a.healthy  # three checks in a row, no answer in between
        await server_b.stop()  # nothing listens any more: connections are refused
        await monitor.check_all()
        assert not b.healthy and b.ejections == 1  # a refused connection ejects at once
        slow["a"] = False
        await server_b.start()
        await monitor.check_all()
        assert a.healthy and b.healthy and a.health_failures == 0
    finally:
        await http.aclose()
        await server_a.stop()
        await server_b.stop()
