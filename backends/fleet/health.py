"""Health checks: every server's ``/health`` periodically, ejecting and re-admitting servers.

With ``scrape_metrics`` each passed check also copies the server's own ``/metrics``
(``backends.scraped_metrics``), unless the server is idle: its page stood still over the last
scrape and the gateway has sent it nothing since. An idle server's page is read every
``scrape_idle_interval_s`` only, so an idle gateway costs next to nothing. With
``served_model`` each passed check also reads what the server reports of the model
(``backends.fleet.remote_revision``), and a changed revision is told to ``on_revision``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from backends.fleet.dispatch_gate import DispatchGate
from backends.fleet.pool import Pool
from backends.fleet.remote_revision import remote_revision, reported_identity
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import parse_upstream_metrics
from backends.upstream import HTTP_ERRORS, HttpSession

HEALTH_FAILURES_TO_EJECT = 3
"""Failed health checks in a row that eject a server. A refused connection ejects at once; an
answer relayed from the server in between wipes the count (a busy server answers slowly)."""


@dataclass(frozen=True)
class _Scrape:
    """A server's last scrape: when, what the gateway had sent it, whether the page changed."""

    at: float
    requests: int
    inflight: int
    still: bool

    def idle(self, server: ServerState) -> bool:
        """Nothing to read since: the page stood still and no request went to the server."""
        return (
            self.still
            and self.inflight == 0
            and server.inflight == 0
            and server.requests == self.requests
        )


class HealthMonitor:
    """Checks every server's ``/health`` periodically; ejects and re-admits; scrapes metrics."""

    def __init__(
        self,
        http: HttpSession,
        pools: Sequence[Pool],
        *,
        interval_s: float,
        timeout_s: float,
        scrape_metrics: bool,
        scrape_idle_interval_s: float = 60.0,
        served_model: str | None = None,
        gate: DispatchGate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``served_model``: read each server's report of it (the backend's revision comes
        from its servers); ``gate``: refreshed from each round's scrapes."""
        self.http = http
        self.pools = list(pools)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.scrape_metrics = scrape_metrics
        self.scrape_idle_interval_s = scrape_idle_interval_s
        self.clock = clock
        self._scraped: dict[str, _Scrape] = {}
        self.last_check = 0.0
        self.served_model = served_model
        self.gate = gate
        self.revision: str | None = None
        """The revision the servers last reported (``served_model`` only)."""
        self.on_revision: Callable[[str], None] | None = None
        self._reported: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start the periodic checks in the running loop (first use; again if they died)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        """One round of checks over every server, concurrently."""
        await asyncio.gather(*(self.check(p, s) for p in self.pools for s in p.servers))
        self.last_check = time.monotonic()
        if self.gate is not None:
            for pool in self.pools:
                self.gate.refresh(pool)
        self._update_revision()

    def _update_revision(self) -> None:
        healthy = {s.url for p in self.pools for s in p.servers if s.healthy}
        reported = [r for url, r in self._reported.items() if url in healthy]
        if not reported:
            return  # nothing answers: the last revision stands
        revision = remote_revision(reported)
        if revision != self.revision:
            self.revision = revision
            if self.on_revision is not None:
                self.on_revision(revision)

    async def check(self, pool: Pool, server: ServerState) -> None:
        """Check one server now: eject, re-admit, read its revision and metrics."""
        session = self.http.session
        try:
            async with session.get(f"{server.url}/health", timeout=self._timeout) as response:
                ok = response.status == 200
                await response.read()  # to the end: the connection goes back to the pool
        except aiohttp.ClientConnectorError:
            pool.eject(server)  # nothing listens: no point in a second try
            return
        except HTTP_ERRORS:
            ok = False
        if not ok:
            server.health_failures += 1
            if server.health_failures >= HEALTH_FAILURES_TO_EJECT:
                pool.eject(server)
            return
        pool.readmit(server)
        if self.served_model is not None:
            identity = await reported_identity(
                session, server.url, self.served_model, self._timeout
            )
            if identity is None:
                self._reported.pop(server.url, None)
            else:
                self._reported[server.url] = identity
        if self.scrape_metrics:
            await self._scrape(server)

    async def _scrape(self, server: ServerState) -> None:
        last = self._scraped.get(server.url)
        now = self.clock()
        if last is not None and last.idle(server) and now - last.at < self.scrape_idle_interval_s:
            # What a scrape would read: the same page, so recent averages see nothing new.
            server.previous_upstream = server.upstream
            return
        with contextlib.suppress(*HTTP_ERRORS, ValueError):
            async with self.http.session.get(
                f"{server.url}/metrics", timeout=self._timeout
            ) as page:
                text = await page.text() if page.status == 200 else None
            if text is not None:
                samples = await asyncio.to_thread(parse_upstream_metrics, text)
                still = samples == server.upstream
                server.previous_upstream, server.upstream = server.upstream, samples
                self._scraped[server.url] = _Scrape(now, server.requests, server.inflight, still)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
