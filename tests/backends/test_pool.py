"""Pools without vLLM: ejection and re-admission, pools by role."""

from __future__ import annotations

import asyncio

import pytest

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.pool import build_pools
from backends.interfaces import BackendError
from tests.backends.pools import make_pool


async def test_no_healthy_server_is_unavailable_and_ejection_wakes_waiters() -> None:
    pool = make_pool([1, 1], max_queue=4)
    a, b = pool.servers
    leases = [await pool.admission.acquire(lambda: pool.healthy()) for _ in range(2)]
    waiter = asyncio.create_task(pool.admission.acquire(lambda: pool.healthy()))
    await asyncio.sleep(0)
    pool.eject(a)
    pool.eject(b)
    with pytest.raises(BackendError) as down:
        await asyncio.wait_for(waiter, 1)
    assert down.value.kind == "unavailable"
    assert down.value.retry_after_s == 5
    with pytest.raises(BackendError):
        await pool.admission.acquire(lambda: pool.healthy())
    assert (a.ejections, b.ejections) == (1, 1)
    for lease in leases:
        lease.release()
    pool.readmit(b)
    assert (await pool.admission.acquire(lambda: pool.healthy())).server is b


def test_build_pools_by_role() -> None:
    pd = VllmBackendConfig(
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
        VllmBackendConfig(name="m", served_model="m", servers=[VllmServer(url="http://h:1")])
    )
    assert mono_prefill is None and mono.role == "both"
