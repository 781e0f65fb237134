"""Health checks against local HTTP servers: ejection after silent failures, re-admission."""

from __future__ import annotations

import asyncio

from aiohttp import web

from backends.fleet.health import HealthMonitor
from backends.upstream import HttpSession
from harness.fake_vllm import FakeServer
from tests.backends.pools import make_pool


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
        # Servers that answer are checked with a long timeout, so a loaded machine never
        # fails them; the stuck one with a short one (it times out however slow the machine).
        monitor = HealthMonitor(http, [pool], interval_s=60, timeout_s=30, scrape_metrics=False)
        stuck = HealthMonitor(http, [pool], interval_s=60, timeout_s=0.05, scrape_metrics=False)
        slow["a"] = True  # answers /health too late: busy, or stuck
        for _ in range(2):
            await stuck.check(pool, a)
        pool.answered(a)  # ...but it just relayed an answer: busy, not dead
        for _ in range(2):
            await stuck.check(pool, a)
        assert a.healthy and a.health_failures == 2
        await stuck.check(pool, a)
        assert not a.healthy  # three checks in a row, no answer in between
        await server_b.stop()  # nothing listens any more: connections are refused
        await monitor.check(pool, b)
        assert not b.healthy and b.ejections == 1  # a refused connection ejects at once
        slow["a"] = False
        await server_b.start()
        await monitor.check_all()
        assert a.healthy and b.healthy and a.health_failures == 0
    finally:
        await http.aclose()
        await server_a.stop()
        await server_b.stop()


def page(hits: float) -> str:
    return (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
    )


async def test_an_idle_server_is_scraped_only_every_idle_interval() -> None:
    state = {"hits": 1.0, "scrapes": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            state["scrapes"] += 1
            return web.Response(text=page(state["hits"]))
        return web.Response(status=200)

    fake = FakeServer(handler)
    await fake.start()
    pool = make_pool([4], urls=[fake.url])
    (server,) = pool.servers
    now = [1000.0]
    http = HttpSession(max_connections=8, read_timeout_s=60, connect_timeout_s=5)
    monitor = HealthMonitor(
        http,
        [pool],
        interval_s=5,
        timeout_s=5,
        scrape_metrics=True,
        scrape_idle_interval_s=60,
        clock=lambda: now[0],
    )

    async def scrapes_after_a_check() -> int:
        await monitor.check_all()
        now[0] += 5
        return state["scrapes"]

    try:
        assert await scrapes_after_a_check() == 1
        assert await scrapes_after_a_check() == 2  # read again: the page was new
        assert await scrapes_after_a_check() == 2  # it stood still, and nothing was sent
        assert server.previous_upstream == server.upstream  # recent averages: nothing new
        assert [s.value for s in server.upstream] == [1.0]
        server.requests += 1  # what admission does for a request sent to the server
        state["hits"] = 3.0
        assert await scrapes_after_a_check() == 3
        assert [s.value for s in server.upstream] == [3.0]
        assert [s.value for s in server.previous_upstream] == [1.0]
        assert await scrapes_after_a_check() == 4  # the page had changed
        assert await scrapes_after_a_check() == 4
        server.inflight = 1  # a request running: read every check
        assert await scrapes_after_a_check() == 5
        server.inflight = 0
        assert await scrapes_after_a_check() == 6  # it was running at the last scrape
        assert await scrapes_after_a_check() == 6
        now[0] += 60  # idle, but the idle interval has passed
        assert await scrapes_after_a_check() == 7
    finally:
        await http.aclose()
        await fake.stop()
