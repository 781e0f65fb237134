"""The fair wait queue of a pool without vLLM: bands, weighted shares, bounds, departures."""

from __future__ import annotations

import asyncio

import pytest

from backends.fleet.admission import Lease
from backends.fleet.fair_queue import FairQueue
from backends.interfaces import BackendError
from foundation.request import QueueTicket
from tests.backends.pools import make_pool


def ticket(tenant: str, **kw: object) -> QueueTicket:
    return QueueTicket(tenant=tenant, **kw)  # type: ignore[arg-type]


def test_start_time_fair_queueing_interleaves_tenants_by_weight() -> None:
    queue = FairQueue()
    loop = asyncio.new_event_loop()
    try:
        for _ in range(6):
            queue.push(loop.create_future(), ticket("a", weight=2.0))
        for _ in range(3):
            queue.push(loop.create_future(), ticket("b"))
        order = []
        while (waiter := queue.pop()) is not None:
            order.append(waiter.tenant)
    finally:
        loop.close()
    # a (weight 2) gets two dispatches for each of b's while both wait; b, queued after all
    # six of a's, is served second
    assert order[:6] == ["a", "b", "a", "a", "b", "a"]
    assert sorted(order) == ["a"] * 6 + ["b"] * 3
    assert not queue and not queue.depth


def test_a_higher_band_goes_first_and_an_idle_tenant_gets_no_credit() -> None:
    queue = FairQueue()
    loop = asyncio.new_event_loop()
    try:
        for _ in range(3):
            queue.push(loop.create_future(), ticket("batcher", band="batch"))
        queue.push(loop.create_future(), ticket("quiet", band="background"))
        queue.push(loop.create_future(), ticket("live"))
        assert queue.depth[("batch", "batcher")] == 3
        assert queue.queued("batcher") == 3
        first = queue.pop()
        assert first is not None and first.tenant == "live"
        for _ in range(3):
            popped = queue.pop()
            assert popped is not None and popped.tenant == "batcher"
        last = queue.pop()
        assert last is not None and last.band == "background"
        # "a" flooded alone for a while; "b" arriving later is served next, not after the flood
        for _ in range(5):
            queue.push(loop.create_future(), ticket("a"))
        for _ in range(2):
            queue.pop()
        queue.push(loop.create_future(), ticket("b"))
        nxt = queue.pop()
        assert nxt is not None and nxt.tenant == "b"
    finally:
        loop.close()


async def test_the_pool_serves_a_trickle_between_a_flood() -> None:
    pool = make_pool([1], max_queue=64)
    held = await pool.admission.acquire(pool.healthy)
    order: list[str] = []
    leases: asyncio.Queue[Lease] = asyncio.Queue()

    async def wait(t: QueueTicket) -> None:
        lease = await pool.admission.acquire(pool.healthy, t)
        order.append(t.tenant)
        await leases.put(lease)

    tasks = [asyncio.create_task(wait(ticket("a"))) for _ in range(8)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(wait(ticket("b"))) for _ in range(2)]
    await asyncio.sleep(0)
    held.release()
    for _ in range(len(tasks)):
        lease = await asyncio.wait_for(leases.get(), 1)
        lease.release()
    await asyncio.gather(*tasks)
    # b queued behind eight of a's, yet is served second and fourth
    assert order.index("b") <= 2
    assert order.count("b") == 2 and order.count("a") == 8
    assert not pool.admission.queue


async def test_the_switch_off_is_first_come_first_served() -> None:
    pool = make_pool([1], max_queue=64)
    held = await pool.admission.acquire(pool.healthy)
    order: list[int] = []
    leases: asyncio.Queue[Lease] = asyncio.Queue()

    async def wait(i: int) -> None:
        lease = await pool.admission.acquire(pool.healthy)  # no ticket
        order.append(i)
        await leases.put(lease)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(wait(i)))
        await asyncio.sleep(0)
    held.release()
    for _ in tasks:
        (await asyncio.wait_for(leases.get(), 1)).release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]


async def test_a_tenant_past_its_queued_bound_is_refused_with_retry_after() -> None:
    pool = make_pool([1], max_queue=64)
    held = await pool.admission.acquire(pool.healthy)
    bounded = ticket("a", max_queued=2)
    waiting = [asyncio.create_task(pool.admission.acquire(pool.healthy, bounded)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(BackendError) as refused:
        await pool.admission.acquire(pool.healthy, bounded)
    assert refused.value.kind == "overloaded" and refused.value.retry_after_s == 2
    assert pool.admission.rejected[("interactive", "a", "tenant_queue_full")] == 1
    # another tenant still queues
    other = asyncio.create_task(pool.admission.acquire(pool.healthy, ticket("b", max_queued=2)))
    await asyncio.sleep(0)
    assert pool.admission.queue.depth[("interactive", "b")] == 1
    for task in (*waiting, other):
        task.cancel()
    await asyncio.gather(*waiting, other, return_exceptions=True)
    assert not pool.admission.queue and pool.admission.waiting == 0
    held.release()


async def test_a_waiter_past_its_max_wait_is_refused_and_leaves_the_queue() -> None:
    """Checked against a refused wait observed as 0 s: it lands in the 0.005 s bucket and the
    test fails."""
    pool = make_pool([1], max_queue=64, timeout_s=30.0)
    held = await pool.admission.acquire(pool.healthy)
    with pytest.raises(BackendError) as refused:
        await pool.admission.acquire(pool.healthy, ticket("a", max_wait_s=0.01))
    assert refused.value.kind == "overloaded"
    assert pool.admission.rejected[("interactive", "a", "wait")] == 1
    assert not pool.admission.queue
    (family,) = pool.admission.waits["interactive"].collect()
    observed = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert observed[("semcache_queue_wait_seconds_count", None)] == 1
    # it waited its 0.01 s before the refusal: above the 0.005 s bucket
    assert observed[("semcache_queue_wait_seconds_bucket", "0.005")] == 0
    assert observed[("semcache_queue_wait_seconds_sum", None)] > 0.005
    held.release()


async def test_a_cancelled_waiter_leaves_the_queue_and_the_slot_goes_on() -> None:
    pool = make_pool([1], max_queue=64)
    held = await pool.admission.acquire(pool.healthy)
    gone = asyncio.create_task(pool.admission.acquire(pool.healthy, ticket("a")))
    stays = asyncio.create_task(pool.admission.acquire(pool.healthy, ticket("b")))
    await asyncio.sleep(0)
    assert pool.admission.queue.total == 2
    gone.cancel()  # the client disconnected
    await asyncio.gather(gone, return_exceptions=True)
    assert pool.admission.queue.depth == {("interactive", "b"): 1}
    held.release()
    lease = await asyncio.wait_for(stays, 1)
    assert lease.server is pool.servers[0]
    lease.release()
