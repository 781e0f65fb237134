"""Miss coalescing: concurrent misses of one key make one fetch (the leader's), the rest wait.

When the leader's fetch raises, every waiter gets the same exception (one backend error is
not retried fifty times). When it ends with no answer (an incomplete one, e.g. the stream was
cut) or the leader is cancelled (its client went away), the waiters start over: one of them
becomes the new leader and fetches its own answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from semcache.entry import CachedAnswer
from semcache.exact.request import CacheRequest, CacheResult, Fill
from semcache.metrics import CacheMetrics

Put = Callable[[CacheRequest, CachedAnswer], Awaitable[CachedAnswer | None]]
"""Stores a leader's answer; returns the entry as stored, or ``None`` when not stored."""

Recent = Callable[[], Awaitable[CachedAnswer | None]]
"""An answer stored since the lookup missed (a flight that ended in between), or ``None``."""


class _LeaderGone(Exception):
    """The leader produced no storable answer or was cancelled: waiters start over."""


class Flights:
    """The misses in flight, at most one per key, and the waiters that joined them."""

    def __init__(self, put: Put, metrics: CacheMetrics | None = None) -> None:
        self.put = put
        self.metrics = metrics
        self._futures: dict[str, asyncio.Future[CachedAnswer]] = {}

    def __contains__(self, digest: object) -> bool:
        return digest in self._futures

    def alone(self, req: CacheRequest, res: CacheResult) -> Flight:
        """A flight nobody joins and that stores nothing (a policy-bypassed request)."""
        return Flight(self, req, res, None)

    async def join_or_lead(
        self, req: CacheRequest, res: CacheResult, recent: Recent | None = None
    ) -> CacheResult | Flight:
        """After a miss: another request's answer (``res``, coalesced), or a flight this
        request leads, one per key at a time.

        ``recent``: a request whose lookup missed may take an answer a leader stored since
        (its flight ended between the lookup and now); ``None`` for ``bypass_read``.
        """
        digest = req.key.digest
        while True:
            fut = self._futures.get(digest)
            if fut is None:
                found = await recent() if recent is not None else None
                if found is not None:
                    res.entry, res.coalesced = found, True
                    return res
                if digest not in self._futures:
                    break
                continue
            try:
                answer = await asyncio.shield(fut)
            except _LeaderGone:
                continue
            if self.metrics:
                self.metrics.coalesced.labels(req.key.model_id).inc()
            res.entry, res.coalesced = answer, True
            return res
        fut = asyncio.get_running_loop().create_future()
        self._futures[digest] = fut
        return Flight(self, req, res, fut)

    def land(self, req: CacheRequest, fut: asyncio.Future[CachedAnswer]) -> None:
        """The flight of ``fut`` is over: the next miss of its key leads a new one."""
        if self._futures.get(req.key.digest) is fut:
            del self._futures[req.key.digest]


class Flight:
    """A miss one request leads: it fetches the answer, then ends the flight exactly once.

    Concurrent requests for the same key wait for the answer :meth:`finish` hands them, or
    get the exception :meth:`fail` hands them (a cancelled or incomplete leader makes them
    start over). A flight without a future (a policy-bypassed request) is joined by nobody
    and stores nothing.
    """

    __slots__ = ("_flights", "_fut", "_over", "req", "result")

    def __init__(
        self,
        flights: Flights,
        req: CacheRequest,
        result: CacheResult,
        fut: asyncio.Future[CachedAnswer] | None,
    ) -> None:
        self._flights = flights
        self.req = req
        self.result = result
        """The lookup's result (MISS / EXPIRED / BYPASS); :meth:`finish` completes it."""
        self._fut = fut
        self._over = False

    def _end(self) -> asyncio.Future[CachedAnswer] | None:
        if self._over:
            raise RuntimeError("this flight has already ended")
        self._over = True
        return self._fut

    async def finish(self, answer: CachedAnswer | None) -> CacheResult:
        """Hand ``answer`` to the waiters and store it (when policy allows: status 200 only).

        ``None`` (an incomplete answer, or none fetched) stores nothing and makes the waiters
        start over.
        """
        fut = self._end()
        res = self.result
        res.entry = answer
        if fut is None:
            return res
        if answer is None:
            self._abort(fut, _LeaderGone())
            return res
        fut.set_result(answer)
        try:
            # still in flight while storing: a request arriving now joins, not misses
            stored = await self._flights.put(self.req, answer)
            if stored is not None:  # the entry as later hits see it (stamped, sealed)
                res.entry, res.stored = stored, True
        finally:
            self._flights.land(self.req, fut)
        return res

    def fail(self, exc: BaseException) -> None:
        """The fetch raised ``exc``: the waiters get it too, or start over when it is a
        cancellation (the leader's client went away)."""
        fut = self._end()
        if fut is not None:
            self._abort(fut, _LeaderGone() if isinstance(exc, asyncio.CancelledError) else exc)

    def _abort(self, fut: asyncio.Future[CachedAnswer], exc: BaseException) -> None:
        fut.set_exception(exc)
        fut.exception()  # mark retrieved: waiters may be none
        self._flights.land(self.req, fut)

    async def run(self, fill: Fill) -> CacheResult:
        """Lead with ``fill``: call it, then finish with its answer (or fail with its error)."""
        try:
            answer = await fill()
        except BaseException as exc:
            self.fail(exc)
            raise
        return await self.finish(answer)
