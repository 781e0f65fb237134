"""The ``semcache_queue_*`` families read off a pool whose fair queue holds, serves and
refuses waiters (no vLLM: the pool's one slot is taken by hand)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.pool_metrics import BackendCollector, BackendStats
from backends.protocol import BackendError
from foundation.request import QueueTicket
from tests.backends.pools import make_pool


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    page = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


async def test_queue_depth_wait_and_rejections_by_band_and_tenant() -> None:
    pool = make_pool([1], max_queue=8)
    registry = CollectorRegistry()
    registry.register(BackendCollector([SimpleNamespace(stats=BackendStats("b", [pool]))]))
    held = await pool.admission.acquire(pool.healthy)
    a = QueueTicket(tenant="a", max_queued=1)
    batch = QueueTicket(tenant="a", band="batch")
    waiting = [
        asyncio.create_task(pool.admission.acquire(pool.healthy, a)),
        asyncio.create_task(pool.admission.acquire(pool.healthy, batch)),
    ]
    await asyncio.sleep(0)
    with pytest.raises(BackendError):
        await pool.admission.acquire(pool.healthy, a)  # a's second live waiter: over its bound
    samples = scrape(registry)
    held_by = (("band", "interactive"), ("pool", "b/decode"), ("tenant", "-"))
    assert samples[("semcache_queue_held", held_by)] == 1  # the slot taken without a ticket
    depth = "semcache_queue_depth"
    assert samples[(depth, (("band", "interactive"), ("pool", "b/decode"), ("tenant", "a")))] == 1
    assert samples[(depth, (("band", "batch"), ("pool", "b/decode"), ("tenant", "a")))] == 1
    rejected = (
        "semcache_queue_rejected_total",
        (
            ("band", "interactive"),
            ("pool", "b/decode"),
            ("reason", "tenant_queue_full"),
            ("tenant", "a"),
        ),
    )
    assert samples[rejected] == 1
    held.release()
    live = await asyncio.wait_for(waiting[0], 1)  # the live waiter goes before the batch one
    assert not waiting[1].done()
    live.release()
    (await asyncio.wait_for(waiting[1], 1)).release()
    samples = scrape(registry)
    wait = "semcache_queue_wait_seconds"
    for band in ("interactive", "batch"):
        assert samples[(f"{wait}_count", (("band", band), ("pool", "b/decode")))] == 1
        assert samples[(f"{wait}_sum", (("band", band), ("pool", "b/decode")))] >= 0
    assert not any(name == depth for name, _ in samples)  # nobody waits now
    assert not any(name == "semcache_queue_held" for name, _ in samples)  # nor holds a slot
