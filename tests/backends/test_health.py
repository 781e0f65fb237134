"""Health checks against local HTTP servers: ejection after silent failures, re-admission."""

from __future__ import annotations

import asyncio

from aiohttp import web

from backends.health import HealthMonitor
from backends.upstream import HttpSession
from tests.backends.pools import make_pool
from tests.support.fake_upstream import FakeServer


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
