"""The dispatch gate without vLLM: servers held by their signals, waiters released by them."""

from __future__ import annotations

import asyncio

from aiohttp import web

from backends.fleet.dispatch_gate import DispatchGate, ServerSignals, scraped_signals
from backends.fleet.health import HealthMonitor
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import parse_upstream_metrics
from backends.upstream import HttpSession
from foundation.request import QueueTicket
from harness.fake_vllm import FakeServer
from tests.backends.pools import make_pool


class Signals:
    """An injectable signal source: what each server's vLLM 'reports', set by the test."""

    def __init__(self) -> None:
        self.now: dict[str, ServerSignals] = {}

    def __call__(self, server: ServerState) -> ServerSignals:
        return self.now.get(server.url, ServerSignals())


def vllm_page(waiting: float, kv: float) -> str:
    return (
        "# HELP vllm:num_requests_waiting Waiting.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        "# HELP vllm:kv_cache_usage_perc KV usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
    )


def test_the_thresholds_and_the_scraped_page() -> None:
    gate = DispatchGate(max_waiting=0, max_kv_usage=0.9)
    assert gate.holds(ServerSignals(waiting=1))
    assert not gate.holds(ServerSignals(waiting=0, kv_usage=0.9))
    assert gate.holds(ServerSignals(waiting=0, kv_usage=0.95))
    assert not gate.holds(ServerSignals())  # nothing reported: nothing to hold on
    lenient = DispatchGate(max_waiting=4, max_kv_usage=None)
    assert not lenient.holds(ServerSignals(waiting=4, kv_usage=1.0))
    assert lenient.holds(ServerSignals(waiting=5))
    assert not DispatchGate(max_waiting=None, max_kv_usage=None).active
    pool = make_pool([4])
    (server,) = pool.servers
    server.upstream = parse_upstream_metrics(vllm_page(waiting=3, kv=0.5))
    assert scraped_signals(server) == ServerSignals(waiting=3.0, kv_usage=0.5)


async def test_a_held_server_takes_nothing_new_until_its_signals_clear() -> None:
    signals = Signals()
    gate = DispatchGate(max_waiting=0, max_kv_usage=0.9, source=signals)
    pool = make_pool([4], max_queue=8)
    (server,) = pool.servers
    running = await pool.admission.acquire(pool.healthy)
    signals.now[server.url] = ServerSignals(waiting=2, kv_usage=0.5)
    gate.refresh(pool)
    assert server.held and not server.free  # 1 of 4 slots used, but vLLM queues
    waiter = asyncio.create_task(pool.admission.acquire(pool.healthy))
    await asyncio.sleep(0)
    assert not waiter.done() and pool.admission.waiting == 1
    running.release()  # the gateway runs nothing there now: one request may go
    lease = await asyncio.wait_for(waiter, 5)
    assert server.inflight == 1
    held = asyncio.create_task(pool.admission.acquire(pool.healthy))
    await asyncio.sleep(0)
    assert not held.done()  # held again: one runs and the signals still say short
    signals.now[server.url] = ServerSignals(waiting=0, kv_usage=0.95)
    gate.refresh(pool)
    await asyncio.sleep(0)
    assert not held.done()  # the KV cache is too full now
    signals.now[server.url] = ServerSignals(waiting=0, kv_usage=0.4)
    gate.refresh(pool)  # the signals clear: the waiter is woken and dispatched
    second = await asyncio.wait_for(held, 5)
    assert not server.held and server.inflight == 2
    lease.release()
    second.release()


async def test_released_waiters_go_by_band_and_fair_share() -> None:
    signals = Signals()
    gate = DispatchGate(max_waiting=0, max_kv_usage=None, source=signals)
    pool = make_pool([1, 8], max_queue=64)
    small, big = pool.servers
    first = await pool.admission.acquire(pool.healthy)
    busy = await pool.admission.acquire(pool.healthy)
    assert {first.server, busy.server} == {small, big}
    signals.now[big.url] = ServerSignals(waiting=1)
    gate.refresh(pool)  # small is full, big is held: everything new waits
    order: list[str] = []

    async def wait(t: QueueTicket) -> None:
        lease = await pool.admission.acquire(pool.healthy, t)
        order.append(t.tenant)
        lease.release()

    tasks = [asyncio.create_task(wait(QueueTicket(tenant="a"))) for _ in range(4)]
    tasks.append(asyncio.create_task(wait(QueueTicket(tenant="batch", band="batch"))))
    tasks.append(asyncio.create_task(wait(QueueTicket(tenant="b"))))
    await asyncio.sleep(0)
    assert not order and pool.admission.waiting == 6
    signals.now[big.url] = ServerSignals(waiting=0)
    gate.refresh(pool)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    # b, queued after a's four, is served second; the batch item after every live request
    assert order[:2] == ["a", "b"] and order[-1] == "batch"
    first.release()
    busy.release()


async def test_each_health_round_refreshes_the_gate_from_the_scraped_pages() -> None:
    state = {"waiting": 3.0}

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            return web.Response(text=vllm_page(state["waiting"], 0.2))
        return web.Response(status=200)

    fake = FakeServer(handler)
    await fake.start()
    pool = make_pool([4], urls=[fake.url], max_queue=8)
    (server,) = pool.servers
    http = HttpSession(max_connections=8, read_timeout_s=60, connect_timeout_s=5)
    monitor = HealthMonitor(
        http,
        [pool],
        interval_s=60,
        timeout_s=30,
        scrape_metrics=True,
        gate=DispatchGate(max_waiting=0, max_kv_usage=None),
    )
    try:
        running = await pool.admission.acquire(pool.healthy)
        await monitor.check_all()
        assert server.held
        waiter = asyncio.create_task(pool.admission.acquire(pool.healthy))
        await asyncio.sleep(0)
        assert not waiter.done()
        state["waiting"] = 0.0
        await monitor.check_all()
        lease = await asyncio.wait_for(waiter, 5)
        assert not server.held
        lease.release()
        running.release()
    finally:
        await http.aclose()
        await fake.stop()
