"""The ``semcache_queue_*`` families read off a pool whose fair queue holds, serves and
refuses waiters (no vLLM: the pool's one slot is taken by hand)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.fleet.pool_metrics import BackendCollector, BackendStats
from backends.interfaces import BackendError
from foundation.request import QueueTicket
from tests.backends.pools import make_pool
from tests.support.stepped_clock import SteppedClock


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    page = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


async def test_queue_depth_wait_and_rejections_by_band_and_tenant() -> None:
    """Checked against waits observed as 0 (the wait read off a clock that does not move):
    the live band's sum is 0, not 0.2, and the test fails."""
    pool = make_pool([1], max_queue=8)
    pool.admission.clock = clock = SteppedClock(0.0)  # how long each waiter waited, set by the test
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
    clock.now = 0.2
    held.release()
    live = await asyncio.wait_for(waiting[0], 1)  # the live waiter goes before the batch one
    assert not waiting[1].done()
    clock.now = 0.7
    live.release()
    (await asyncio.wait_for(waiting[1], 1)).release()
    samples = scrape(registry)
    wait = "semcache_queue_wait_seconds"
    # the live waiter waited 0.2 s (until the slot was released), the batch one 0.7 s
    for band, waited, bucket, below in (
        ("interactive", 0.2, "0.25", "0.1"),
        ("batch", 0.7, "1.0", "0.5"),
    ):
        labels = (("band", band), ("pool", "b/decode"))
        assert samples[(f"{wait}_count", labels)] == 1
        assert samples[(f"{wait}_sum", labels)] == pytest.approx(waited)
        assert (
            samples[(f"{wait}_bucket", (("band", band), ("le", bucket), ("pool", "b/decode")))] == 1
        )
        assert (
            samples[(f"{wait}_bucket", (("band", band), ("le", below), ("pool", "b/decode")))] == 0
        )
    assert not any(name == depth for name, _ in samples)  # nobody waits now
    assert not any(name == "semcache_queue_held" for name, _ in samples)  # nor holds a slot
