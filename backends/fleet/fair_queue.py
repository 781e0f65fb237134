"""The wait queue of one pool: priority bands, and start-time fair queueing between tenants.

A request that finds every server of its pool full waits here with a ``QueueTicket`` (who
it is for, its band, its weight and bounds: plain data the server fills from its config).
When a slot frees, the waiter of the highest band goes first (``interactive`` over ``batch``
over ``background``); inside a band the waiter with the smallest virtual start time goes.

Start-time fair queueing (Goyal et al., 1996): each request of tenant ``t`` with weight
``w`` gets the start tag ``S = max(V, F_t)`` and moves ``F_t = S + 1/w``; the band's virtual
time ``V`` is the start tag of the last request dispatched. A tenant with twice the weight
gets twice the dispatches while both wait; a tenant that was idle starts at ``V`` (no credit
saved up, no debt carried), so a trickle is served next to a flood at once. Every request
costs one unit: the slots it competes for are per-server concurrency slots.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable

from foundation.request import BANDS, Band, QueueTicket

FIFO = QueueTicket()
"""A request without a ticket (the queue switched off): one line, first come first served."""


class Waiter:
    """One queued request: its future is set when it may try to take a slot."""

    __slots__ = ("band", "future", "gone", "start", "tenant")

    def __init__(self, future: asyncio.Future[None], tenant: str, band: Band, start: float):
        self.future = future
        self.tenant = tenant
        self.band = band
        self.start = start
        self.gone = False


class FairQueue:
    """Waiters of one pool, handed out band first, then by virtual start time."""

    def __init__(self) -> None:
        self._heaps: dict[Band, list[tuple[float, int, Waiter]]] = {b: [] for b in BANDS}
        self._virtual: dict[Band, float] = dict.fromkeys(BANDS, 0.0)
        self._finish: dict[tuple[Band, str], float] = {}
        self._seq = itertools.count()
        self.depth: Counter[tuple[Band, str]] = Counter()
        """Waiters now, by (band, tenant)."""
        self.total = 0

    def __bool__(self) -> bool:
        return self.total > 0

    def queued(self, tenant: str) -> int:
        """Waiters of ``tenant`` now, in every band."""
        return sum(self.depth[(band, tenant)] for band in BANDS)

    def push(self, future: asyncio.Future[None], ticket: QueueTicket) -> Waiter:
        band, tenant = ticket.band, ticket.tenant
        start = max(self._virtual[band], self._finish.get((band, tenant), 0.0))
        self._finish[(band, tenant)] = start + 1.0 / ticket.weight
        waiter = Waiter(future, tenant, band, start)
        heapq.heappush(self._heaps[band], (start, next(self._seq), waiter))
        self.depth[(band, tenant)] += 1
        self.total += 1
        return waiter

    def requeue(self, waiter: Waiter, future: asyncio.Future[None]) -> Waiter:
        """``waiter`` woken but finding no slot waits again, keeping its start tag."""
        again = Waiter(future, waiter.tenant, waiter.band, waiter.start)
        heapq.heappush(self._heaps[waiter.band], (waiter.start, next(self._seq), again))
        self.depth[(waiter.band, waiter.tenant)] += 1
        self.total += 1
        return again

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out (it left: timed out, cancelled); False if already handed out."""
        if waiter.gone:
            return False
        self._forget(waiter)
        return True

    def _forget(self, waiter: Waiter) -> None:
        waiter.gone = True
        self.depth[(waiter.band, waiter.tenant)] -= 1
        if not self.depth[(waiter.band, waiter.tenant)]:
            del self.depth[(waiter.band, waiter.tenant)]
        self.total -= 1

    def flows(self) -> Iterable[tuple[Band, str]]:
        """The (band, tenant) pairs with a waiter now."""
        return self.depth.keys()

    def pop(self, eligible: Callable[[Band, str], bool] | None = None) -> Waiter | None:
        """The next waiter to serve (taken out of the queue), or None when none waits;
        ``eligible``: waiters of flows it refuses stay queued, in their place."""
        for band in BANDS:
            heap = self._heaps[band]
            skipped: list[tuple[float, int, Waiter]] = []
            found: Waiter | None = None
            while heap:
                entry = heapq.heappop(heap)
                start, _, waiter = entry
                if waiter.gone:
                    continue  # left while queued
                if eligible is not None and not eligible(band, waiter.tenant):
                    skipped.append(entry)
                    continue
                self._virtual[band] = start
                self._forget(waiter)
                found = waiter
                break
            for entry in skipped:
                heapq.heappush(heap, entry)
            if found is not None:
                return found
        return None
