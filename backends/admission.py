"""Admission to one pool's servers: per-server limits and a bounded FIFO wait queue.

Each server runs at most ``limit`` requests of this gateway at once; a request that finds every
acceptable server full waits in the queue (at most ``max_queue`` waiters, at most
``queue_timeout_s``), past which it is refused as ``overloaded`` (HTTP 429 with Retry-After)
instead of piling up. With no healthy server left it is refused as ``unavailable`` (HTTP 503
with Retry-After).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from backends.protocol import BackendError
from backends.servers import ServerState


class Lease:
    """One request's slot on one server; ``release`` (idempotent) frees it."""

    def __init__(self, admission: Admission, server: ServerState) -> None:
        self.admission = admission
        self.server = server
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.admission.release(self.server)


class Admission:
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
    ) -> None:
        self.backend = backend
        self.role = role
        self.servers = servers
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.unavailable_retry_after_s = unavailable_retry_after_s
        self.waiting = 0
        self.refused: Counter[str] = Counter()
        """Requests refused, by kind (``overloaded`` → 429, ``unavailable`` → 503)."""
        self._waiters: deque[asyncio.Future[None]] = deque()

    def _any_healthy(self) -> bool:
        return any(s.healthy for s in self.servers)

    def _unavailable(self) -> BackendError:
        self.refused["unavailable"] += 1
        return BackendError(
            "unavailable",
            f"no healthy {self.role} server for backend {self.backend}",
            retry_after_s=self.unavailable_retry_after_s,
        )

    def _overloaded(self, why: str) -> BackendError:
        self.refused["overloaded"] += 1
        return BackendError(
            "overloaded",
            f"backend {self.backend} is overloaded ({why})",
            retry_after_s=self.retry_after_s,
        )

    def _take(self, order: Iterable[ServerState]) -> Lease | None:
        for server in order:
            if server.free:
                server.inflight += 1
                server.requests += 1
                return Lease(self, server)
        return None

    def try_acquire(self, order: Iterable[ServerState]) -> Lease | None:
        """A slot on the first free server of ``order`` now, or None (never waits)."""
        if self._waiters:
            return None  # first come, first served: waiters go before newcomers
        return self._take(order)

    async def acquire(self, rank: Callable[[], Sequence[ServerState]]) -> Lease:
        """A slot on the first free server ``rank()`` names (re-ranked after each wait).

        Raises ``BackendError("unavailable")`` when no server is healthy and
        ``BackendError("overloaded")`` when the queue is full or the wait too long.
        """
        if not self._any_healthy():
            raise self._unavailable()
        lease = self.try_acquire(rank())
        if lease is not None:
            return lease
        if self.waiting >= self.max_queue:
            raise self._overloaded(f"{self.waiting} requests already wait")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout_s
        self.waiting += 1
        try:
            while True:
                waiter: asyncio.Future[None] = loop.create_future()
                self._waiters.append(waiter)
                try:
                    async with asyncio.timeout_at(deadline):
                        await waiter
                except BaseException as exc:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                    elif waiter.done() and not waiter.cancelled():
                        self.wake_one()  # woken, but leaving: pass the free slot on
                    if isinstance(exc, TimeoutError):
                        why = f"no free server within {self.queue_timeout_s:g} s"
                        raise self._overloaded(why) from None
                    raise
                if not self._any_healthy():
                    raise self._unavailable()
                lease = self._take(rank())
                if lease is not None:
                    if self._waiters and any(s.free for s in self.servers):
                        self.wake_one()
                    return lease
        finally:
            self.waiting -= 1

    def release(self, server: ServerState) -> None:
        """A slot on ``server`` is free again (called by ``Lease.release``)."""
        server.inflight -= 1
        if server.idle is not None and not server.inflight:
            server.idle.set()  # a draining server's last request: it may leave
        self.wake_one()

    def wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        """Every waiter re-checks the servers (one left or came back)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
