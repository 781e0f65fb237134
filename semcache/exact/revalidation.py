"""Stale-while-revalidate (RFC 5861): one background refresh per stale key, never two.

A refresh leads (or joins) the key's flight like any miss, so it never races a request that
is already fetching the same answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from semcache.exact.coalescing import Flights
from semcache.exact.request import CacheRequest, CacheResult, CacheStatus, Fill
from semcache.metrics import CacheMetrics

log = logging.getLogger("semcache.exact")


class Refreshes:
    """The background refreshes of stale answers in progress, one per key."""

    def __init__(self, flights: Flights, metrics: CacheMetrics | None = None) -> None:
        self._flights = flights
        self.metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    def schedule(self, req: CacheRequest, fill: Fill) -> None:
        """Refresh the request's stale answer with ``fill`` in the background, unless a refresh
        or a fetch of that key is already under way."""
        digest = req.key.digest
        if self._closed or digest in self._tasks or digest in self._flights:
            return
        task = asyncio.create_task(self._refresh(req, fill), name=f"semcache-swr-{digest[:12]}")
        self._tasks[digest] = task
        task.add_done_callback(lambda _t: self._tasks.pop(digest, None))

    async def _refresh(self, req: CacheRequest, fill: Fill) -> None:
        fresh_req = msgspec.structs.replace(
            req, control=msgspec.structs.replace(req.control, bypass_read=False, no_store=False)
        )
        outcome = "stored"
        try:
            got = await self._flights.join_or_lead(
                fresh_req, CacheResult(status=CacheStatus.MISS, key=req.key)
            )
            res = got if isinstance(got, CacheResult) else await got.run(fill)
            if res.entry is None:
                outcome = "incomplete"
            elif not res.stored and not res.coalesced:
                outcome = "not_stored"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = "error"
            log.warning("background refresh of %s failed: %s", req.key.short_id, exc)
        finally:
            if self.metrics:
                self.metrics.refreshes.labels(req.key.model_id, outcome).inc()

    async def wait(self) -> None:
        """Wait for the refreshes in progress."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def aclose(self) -> None:
        """Schedule no more refreshes; cancel those in progress and wait for them to end."""
        self._closed = True
        for t in list(self._tasks.values()):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
