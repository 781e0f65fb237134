"""The Backends page's fair-queue tables: waits per band, waiters and refusals per band and
tenant, read from the same registry as ``/metrics``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from backends.fleet.pool import Pool
from backends.fleet.pool_metrics import QueueFamilies
from backends.interfaces import BackendError
from foundation.request import QueueTicket
from server.dashboard import figures as fig
from tests.backends.pools import make_pool
from tests.server.dashboard.test_kv_view import render_backends


class Families:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        families = QueueFamilies()
        families.add("b/decode", self.pool)
        yield from families.families()


async def test_the_queue_tables_show_waits_by_band_and_waiters_by_tenant() -> None:
    pool = make_pool([1], max_queue=8, timeout_s=30)
    held = await pool.admission.acquire(pool.healthy)
    a = QueueTicket(tenant="a", max_queued=2)
    waiting = [asyncio.create_task(pool.admission.acquire(pool.healthy, a)) for _ in range(2)]
    batch = asyncio.create_task(
        pool.admission.acquire(pool.healthy, QueueTicket(tenant="a", band="batch"))
    )
    await asyncio.sleep(0)
    with pytest.raises(BackendError):
        await pool.admission.acquire(pool.healthy, a)  # a's third live waiter is refused
    registry = CollectorRegistry()
    registry.register(Families(pool))
    queue = fig.fair_queue(fig.read_samples(registry))
    assert queue["bands"] == []  # nobody has finished waiting yet
    rows = {(r["band"], r["tenant"]): r for r in queue["tenants"]}
    assert rows[("interactive", "a")]["depth"] == 2
    assert rows[("interactive", "a")]["rejected"] == {"tenant_queue_full": 1}
    assert rows[("batch", "a")]["depth"] == 1
    held.release()
    first = await asyncio.wait_for(waiting[0], 5)
    queue = fig.fair_queue(fig.read_samples(registry))
    (band,) = queue["bands"]
    assert (band["pool"], band["band"], band["waited"]) == ("b/decode", "interactive", 1.0)
    assert band["wait_p99_s"] is not None
    html = render_backends(
        {"servers": [], "pools": [], "kv": [], "queue": queue, "semantic_loaded": False}
    )
    assert "tenant_queue_full 1" in html and 'id="queue-bands"' in html
    for task in (waiting[1], batch):
        task.cancel()
    first.release()


def test_no_queueing_gives_no_rows() -> None:
    assert fig.fair_queue(fig.read_samples(CollectorRegistry())) == {"bands": [], "tenants": []}
    html = render_backends({"servers": [], "pools": [], "kv": [], "semantic_loaded": False})
    assert "No request has waited for a full pool yet." in html
