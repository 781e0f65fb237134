"""Admission to one pool's servers: per-server limits and a bounded wait queue.

Each server runs at most ``limit`` requests of this gateway at once; a request that finds every
acceptable server full waits in the queue (at most ``max_queue`` waiters, at most
``queue_timeout_s``), past which it is refused as ``overloaded`` (HTTP 429 with Retry-After)
instead of piling up. With no healthy server left it is refused as ``unavailable`` (HTTP 503
with Retry-After).

The queue (``backends.fleet.fair_queue``) serves waiters by band, then fairly between tenants, from
the ``QueueTicket`` each request brings; without one (the ``[queue]`` switch off) every
request has the same ticket and the queue is first come, first served. A ticket's own bounds
(waiters per tenant, wait) refuse as ``overloaded`` too.

Fair order alone cannot help a tenant that arrives when a flood holds every slot: it still
waits for one to free. So, with a ticket's ``share_window_s``, a flow (a tenant in a band)
holds at most its weighted share of the pool's slots while other flows are active (holding,
waiting, or seen less than ``share_window_s`` ago): a slot stays free for the trickle that
comes back, and a flow alone still takes every slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import Histogram

from backends.fleet.fair_queue import FIFO, FairQueue, Waiter
from backends.fleet.server_state import ServerState
from backends.interfaces import BackendError
from foundation.request import Band, QueueTicket

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


Flow = tuple[Band, str]
"""A tenant's requests in one band."""
FIFO_FLOW: Flow = (FIFO.band, FIFO.tenant)


class Lease:
    """One request's slot on one server; ``release`` (idempotent) frees it."""

    def __init__(self, admission: SlotAdmission, server: ServerState, flow: Flow) -> None:
        self.admission = admission
        self.server = server
        self.flow = flow
        self._held = True
        self._charged = 0

    def charge(self, tokens: int) -> None:
        """The server has ``tokens`` of this request's prompt to compute (its backlog, which
        KV placement reads) until ``settle`` or ``release``."""
        self.server.pending_tokens += tokens
        self._charged += tokens

    def settle(self) -> None:
        """The prompt is computed (its first token came): the backlog drops it."""
        self.server.pending_tokens -= self._charged
        self._charged = 0

    def release(self) -> None:
        if self._held:
            self._held = False
            self.settle()
            self.admission.release(self.server, self.flow)


class SlotAdmission:
    """Hands out slots on ``servers`` (a pool's list, shared) first come, first served."""

    def __init__(
        self,
        backend: str,
        role: str,
        servers: Sequence[ServerState],
        *,
        max_queue: int,
        queue_timeout_s: float,
        retry_after_s: int,
        unavailable_retry_after_s: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.clock = clock
        """Monotonic seconds: when each flow was last seen, how long each waiter waited
        (tests set it)."""
        self.role = role
        self.servers = servers
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.unavailable_retry_after_s = unavailable_retry_after_s
        self.waiting = 0
        self.refused: Counter[str] = Counter()
        """Requests refused, by kind (``overloaded`` → 429, ``unavailable`` → 503)."""
        self.queue = FairQueue()
        self.rejected: Counter[tuple[str, str, str]] = Counter()
        """Queued or queueing requests refused, by (band, tenant, reason): ``queue_full``,
        ``tenant_queue_full``, ``wait``."""
        self.waits: dict[str, Histogram] = {}
        """Seconds each request that queued waited, by band (registered nowhere:
        ``BackendCollector`` exposes them)."""
        self.holding: Counter[Flow] = Counter()
        """Slots each flow holds now."""
        self._seen: dict[Flow, tuple[float, float, float]] = {}
        """Each flow's last request (monotonic time), weight and share window."""
        self._recheck: asyncio.TimerHandle | None = None
        """One pending wake for when a quiet flow's window lapses (not one per release)."""

    def _any_healthy(self) -> bool:
        return any(s.healthy for s in self.servers)

    def _unavailable(self) -> BackendError:
        self.refused["unavailable"] += 1
        return BackendError(
            "unavailable",
            f"no healthy {self.role} server for backend {self.backend}",
            retry_after_s=self.unavailable_retry_after_s,
        )

    def _overloaded(self, why: str, ticket: QueueTicket, reason: str) -> BackendError:
        self.refused["overloaded"] += 1
        self.rejected[(ticket.band, ticket.tenant, reason)] += 1
        return BackendError(
            "overloaded",
            f"backend {self.backend} is overloaded ({why})",
            retry_after_s=self.retry_after_s,
        )

    def _take(self, order: Iterable[ServerState], ticket: QueueTicket) -> Lease | None:
        flow = (ticket.band, ticket.tenant)
        if not self._within_share(flow):
            return None
        for server in order:
            if server.free:
                server.inflight += 1
                server.requests += 1
                self.holding[flow] += 1
                return Lease(self, server, flow)
        return None

    def _see(self, flow: Flow, ticket: QueueTicket) -> None:
        if ticket.share_window_s > 0:
            self._seen[flow] = (self.clock(), ticket.weight, ticket.share_window_s)

    def _within_share(self, flow: Flow) -> bool:
        """Whether ``flow`` may take one more slot: always, unless other flows are active and
        it already holds its weighted share of the healthy servers' slots."""
        mine = self._seen.get(flow)
        if mine is None or not self.holding[flow]:
            return True  # no cap asked for, or it holds nothing yet
        now = self.clock()
        waiting = set(self.queue.flows())
        weights = 0.0
        for other, (at, weight, window) in list(self._seen.items()):
            if self.holding[other] or other in waiting or now - at < window:
                weights += weight
            elif other != flow:
                del self._seen[other]  # gone quiet: forgotten
        if weights <= mine[1]:
            return True  # alone
        slots = sum(s.limit for s in self.servers if s.healthy)
        share = max(1, math.floor(slots * mine[1] / weights))
        return self.holding[flow] < share

    def try_acquire(self, order: Iterable[ServerState], ticket: QueueTicket = FIFO) -> Lease | None:
        """A slot on the first free server of ``order`` now, or None (never waits)."""
        if self.queue:
            return None  # waiters go before newcomers
        return self._take(order, ticket)

    def _wait_histogram(self, band: str) -> Histogram:
        histogram = self.waits.get(band)
        if histogram is None:
            histogram = self.waits[band] = Histogram(
                "semcache_queue_wait_seconds", "", buckets=WAIT_BUCKETS, registry=None
            )
        return histogram

    async def acquire(
        self, rank: Callable[[], Sequence[ServerState]], ticket: QueueTicket | None = None
    ) -> Lease:
        """A slot on the first free server ``rank()`` names (re-ranked after each wait).

        Raises ``BackendError("unavailable")`` when no server is healthy and
        ``BackendError("overloaded")`` when the queue (or the ticket's tenant's share of it)
        is full or the wait too long. A cancelled waiter (its client left) leaves the queue.
        """
        if not self._any_healthy():
            raise self._unavailable()
        ticket = ticket or FIFO
        self._see((ticket.band, ticket.tenant), ticket)
        lease = self.try_acquire(rank(), ticket)
        if lease is not None:
            return lease
        if self.waiting >= self.max_queue:
            why = f"{self.waiting} requests already wait"
            raise self._overloaded(why, ticket, "queue_full")
        if ticket.max_queued is not None and self.queue.queued(ticket.tenant) >= ticket.max_queued:
            why = f"{ticket.max_queued} requests of tenant {ticket.tenant} already wait"
            raise self._overloaded(why, ticket, "tenant_queue_full")
        wait_s = self.queue_timeout_s
        if ticket.max_wait_s is not None:
            wait_s = min(wait_s, ticket.max_wait_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        queued_at = self.clock()
        self.waiting += 1
        waiter: Waiter | None = None
        try:
            while True:
                future: asyncio.Future[None] = loop.create_future()
                if waiter is None:
                    waiter = self.queue.push(future, ticket)
                    if any(s.free for s in self.servers):
                        self.wake_one()  # the slot free for it, or one a capped flow left
                else:
                    waiter = self.queue.requeue(waiter, future)
                try:
                    async with asyncio.timeout_at(deadline):
                        await future
                except BaseException as exc:
                    if not self.queue.remove(waiter) and future.done() and not future.cancelled():
                        self.wake_one()  # woken, but leaving: pass the free slot on
                    if isinstance(exc, TimeoutError):
                        self._wait_histogram(ticket.band).observe(self.clock() - queued_at)
                        why = f"no free server within {wait_s:g} s"
                        raise self._overloaded(why, ticket, "wait") from None
                    raise
                if not self._any_healthy():
                    raise self._unavailable()
                lease = self._take(rank(), ticket)
                if lease is not None:
                    self._wait_histogram(ticket.band).observe(self.clock() - queued_at)
                    if self.queue and any(s.free for s in self.servers):
                        self.wake_one()
                    return lease
        finally:
            self.waiting -= 1

    def release(self, server: ServerState, flow: Flow = FIFO_FLOW) -> None:
        """A slot on ``server`` is free again (called by ``Lease.release``)."""
        server.inflight -= 1
        self.holding[flow] -= 1
        if not self.holding[flow]:
            del self.holding[flow]
        if server.idle is not None and not server.inflight:
            server.idle.set()  # a draining server's last request: it may leave
        seen = self._seen.get(flow)
        if seen is not None:
            self._seen[flow] = (self.clock(), seen[1], seen[2])
            if self.queue:  # when this flow goes quiet, a capped one may take more
                self._schedule_recheck(seen[2])
        self.wake_one()

    def _schedule_recheck(self, delay_s: float) -> None:
        if self._recheck is not None:
            return  # the pending one reschedules itself while anything waits
        with contextlib.suppress(RuntimeError):  # no loop: nothing waits either
            self._recheck = asyncio.get_running_loop().call_later(delay_s, self._on_recheck)

    def _on_recheck(self) -> None:
        self._recheck = None
        self.wake_one()
        if self.queue:  # the next window to lapse, if any is still running
            now = self.clock()
            ends = [at + window - now for at, _, window in self._seen.values() if at + window > now]
            if ends:
                self._schedule_recheck(min(ends))

    def wake_one(self) -> None:
        """The next waiter (by band, then fair share) allowed a slot tries to take it."""
        while (waiter := self.queue.pop(self._eligible)) is not None:
            if not waiter.future.done():
                waiter.future.set_result(None)
                return

    def _eligible(self, band: Band, tenant: str) -> bool:
        return self._within_share((band, tenant))

    def wake_all(self) -> None:
        """Every waiter re-checks the servers (one left or came back)."""
        while (waiter := self.queue.pop()) is not None:
            if not waiter.future.done():
                waiter.future.set_result(None)
