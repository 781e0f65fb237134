"""Stale-while-revalidate (RFC 5861): one background refresh per stale key, never two.

A refresh leads (or joins) the key's flight like any miss, so it never races a request that
is already fetching the same answer. Leading, it reads the tiers again before fetching: a
lookup that read the stale answer while the previous refresh stored the fresh one schedules
a refresh after that one ended, and that refresh finds the key fresh and fetches nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec

from semcache.exact.coalescing import Flight, Flights
from semcache.exact.request import CacheRequest, CacheResult, CacheStatus, Fill
from semcache.metrics import CacheMetrics

log = logging.getLogger("semcache.exact")

FreshStored = Callable[[CacheRequest], Awaitable[bool]]
"""Whether a tier holds a fresh answer to the request now."""


class Refreshes:
    """The background refreshes of stale answers in progress, one per key."""

    def __init__(
        self, flights: Flights, fresh_stored: FreshStored, metrics: CacheMetrics | None = None
    ) -> None:
        self._flights = flights
        self._fresh_stored = fresh_stored
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
            if isinstance(got, Flight) and await self._fresh_already(got):
                outcome = "already_fresh"
                return
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

    async def _fresh_already(self, flight: Flight) -> bool:
        """Whether the key is fresh again (a refresh or fetch that ended after this refresh's
        lookup read the stale answer stored it); if so ``flight`` ends with nothing fetched.

        Asked as the key's only fetcher, so any fetch that ended before has stored its answer.
        Requests that joined meanwhile start over, each by its own rules (``no-cache``,
        ``max-age``).
        """
        try:
            fresh = await self._fresh_stored(flight.req)
        except BaseException as exc:
            flight.fail(exc)
            raise
        if fresh:
            await flight.finish(None)
        return fresh

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
