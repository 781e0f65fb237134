"""Admission without vLLM: per-server limits, the bounded FIFO wait queue, refusals."""

from __future__ import annotations

import asyncio

import pytest

from backends.protocol import BackendError
from tests.backends.pools import make_pool


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
