"""Admission without vLLM: per-server limits, the bounded FIFO wait queue, refusals."""

from __future__ import annotations

import asyncio

import pytest

from backends.interfaces import BackendError
from foundation.request import QueueTicket
from tests.backends.pools import make_pool
from tests.support.stepped_clock import SteppedClock


async def test_a_server_takes_at_most_its_limit_then_the_next_one() -> None:
    pool = make_pool([2, 1])
    a, b = pool.servers
    leases = [await pool.admission.acquire(lambda: [a, b]) for _ in range(3)]
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
    held = await pool.admission.acquire(lambda: [server])
    waiters = [asyncio.create_task(pool.admission.acquire(lambda: [server])) for _ in range(2)]
    await asyncio.sleep(0)
    assert pool.admission.waiting == 2
    with pytest.raises(BackendError) as refused:
        await pool.admission.acquire(lambda: [server])
    assert refused.value.kind == "overloaded"
    assert refused.value.retry_after_s == 2
    held.release()
    first = await asyncio.wait_for(waiters[0], 1)  # FIFO: the first waiter goes first
    assert not waiters[1].done()
    first.release()
    second = await asyncio.wait_for(waiters[1], 1)
    second.release()
    assert server.inflight == 0 and pool.admission.waiting == 0
    assert pool.admission.refused["overloaded"] == 1


async def test_a_wait_longer_than_the_queue_timeout_is_refused() -> None:
    pool = make_pool([1], max_queue=4, timeout_s=0.05)
    (server,) = pool.servers
    held = await pool.admission.acquire(lambda: [server])
    with pytest.raises(BackendError) as refused:
        await pool.admission.acquire(lambda: [server])
    assert refused.value.kind == "overloaded"
    assert pool.admission.waiting == 0
    held.release()
    (await pool.admission.acquire(lambda: [server])).release()  # the slot was not lost


async def test_a_cancelled_waiter_leaves_the_queue_and_passes_its_turn() -> None:
    pool = make_pool([1], max_queue=4)
    (server,) = pool.servers
    held = await pool.admission.acquire(lambda: [server])
    cancelled = asyncio.create_task(pool.admission.acquire(lambda: [server]))
    patient = asyncio.create_task(pool.admission.acquire(lambda: [server]))
    await asyncio.sleep(0)
    cancelled.cancel()
    held.release()
    lease = await asyncio.wait_for(patient, 1)
    assert lease.server is server and pool.admission.waiting == 0
    lease.release()


def flow(tenant: str, band: str = "interactive") -> QueueTicket:
    return QueueTicket(tenant=tenant, band=band, share_window_s=1.0)  # type: ignore[arg-type]


async def test_a_flow_alone_takes_every_slot_but_only_its_share_beside_another() -> None:
    pool = make_pool([2], max_queue=8)
    (server,) = pool.servers
    pool.admission.clock = clock = SteppedClock(0.0)
    a, b = flow("a"), flow("b")
    a1 = await pool.admission.acquire(lambda: [server], a)
    a2 = await pool.admission.acquire(lambda: [server], a)  # alone: both slots
    b1 = asyncio.create_task(pool.admission.acquire(lambda: [server], b))
    a3 = asyncio.create_task(pool.admission.acquire(lambda: [server], a))
    await asyncio.sleep(0)
    a1.release()
    got_b = await asyncio.wait_for(b1, 1)  # b's turn first (fair order)
    got_b.release()
    await asyncio.sleep(0)
    # b is still active (seen 0 s ago): a holds its share (one of two), so the slot b left
    # stays free for b's next request, which takes it at once.
    assert not a3.done() and server.inflight == 1
    again = await asyncio.wait_for(pool.admission.acquire(lambda: [server], b), 1)
    again.release()
    clock.now = 1.5  # b quiet for longer than the window: a may take every slot again
    pool.admission.wake_one()
    third = await asyncio.wait_for(a3, 1)
    assert server.inflight == 2
    for lease in (a2, third):
        lease.release()
    assert server.inflight == 0 and not pool.admission.holding


async def test_without_a_window_a_free_slot_goes_to_whoever_waits() -> None:
    pool = make_pool([2], max_queue=8)
    (server,) = pool.servers
    a, b = QueueTicket(tenant="a"), QueueTicket(tenant="b")
    a1 = await pool.admission.acquire(lambda: [server], a)
    b1 = await pool.admission.acquire(lambda: [server], b)
    a2 = asyncio.create_task(pool.admission.acquire(lambda: [server], a))
    await asyncio.sleep(0)
    b1.release()
    (await asyncio.wait_for(a2, 1)).release()  # work-conserving: a takes b's slot
    a1.release()


async def test_a_batch_flow_leaves_a_slot_to_live_traffic_of_the_same_tenant() -> None:
    pool = make_pool([2], max_queue=8)
    (server,) = pool.servers
    pool.admission.clock = SteppedClock(0.0)
    live, batch = flow("t"), flow("t", "batch")
    first = await pool.admission.acquire(lambda: [server], live)
    first.release()  # live traffic was here a moment ago
    b1 = await pool.admission.acquire(lambda: [server], batch)
    b2 = asyncio.create_task(pool.admission.acquire(lambda: [server], batch))
    await asyncio.sleep(0)
    assert not b2.done() and server.inflight == 1  # one slot kept for live traffic
    (await asyncio.wait_for(pool.admission.acquire(lambda: [server], live), 1)).release()
    b1.release()
    (await asyncio.wait_for(b2, 1)).release()
