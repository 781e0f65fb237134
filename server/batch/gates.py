"""Capacity gates: batch items start on a backend only while it has idle capacity.

Before an item is claimed, and again before it runs, its backend's gate checks that the
backend's servers are under the per-server limit live traffic uses and, by default, that no
synchronous request is in flight there (or was, less than ``sync_idle_s`` ago). A live
request arriving stops the batch items running on its backend (see ``sync_arrival``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol, TypeGuard

from backends.registry import ModelRegistry
from server.batch.settings import BatchSettings


class CapacityProbe(Protocol):
    """What a backend client reports about its load (``VllmClient`` has it)."""

    def inflight(self) -> int: ...

    def has_capacity(self, per_server_limit: int | None = None) -> bool: ...


class BackendGate:
    """Lets batch items onto one backend only while it has idle capacity."""

    def __init__(
        self,
        probe: CapacityProbe | None,
        settings: BatchSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.settings = settings
        self.running = 0
        """Batch items this gateway runs on the backend now."""
        self._clock = clock
        self._sync_seen = -1e9
        self._arrival: asyncio.Future[None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def sync_inflight(self) -> int:
        if self.probe is None:
            return 0
        return max(0, self.probe.inflight() - self.running)

    def free(self) -> bool:
        if self.running >= self.settings.max_inflight:
            return False
        if self.probe is None:
            return True  # an in-process backend: only the gateway's own limit applies
        if not self.probe.has_capacity(self.settings.per_server_limit):
            return False
        if not self.settings.yield_to_sync:
            return True
        return not self.sync_busy()

    def sync_busy(self) -> bool:
        """A synchronous request is in flight, or was less than ``sync_idle_s`` ago."""
        now = self._clock()
        if self.sync_inflight() > 0:
            self._sync_seen = now
            return True
        return now - self._sync_seen < self.settings.sync_idle_s

    async def wait_free(self) -> None:
        while not self.free():  # noqa: ASYNC110 (the backend's counters have no event)
            await asyncio.sleep(self.settings.capacity_poll_s)

    def sync_arrival(self) -> asyncio.Future[None]:
        """Done when a live request comes for the backend: announced by the route
        (:meth:`live_request`) or seen in the backend's load. One future (and one watcher) is
        shared by all the batch items running there."""
        if self._arrival is None or self._arrival.done():
            self._arrival = asyncio.get_running_loop().create_future()
            self._watcher = asyncio.create_task(self._watch_sync(self._arrival))
        return self._arrival

    async def _watch_sync(self, arrival: asyncio.Future[None]) -> None:
        # Catches live requests no route announced (e.g. the OpenAI routes).
        while self.probe is None or self.sync_inflight() == 0:  # noqa: ASYNC110 (no event)
            await asyncio.sleep(self.settings.capacity_poll_s)
        self._sync_seen = self._clock()
        if not arrival.done():
            arrival.set_result(None)

    def live_request(self) -> None:
        """A live request for this backend is about to be sent: batch work stops now, before
        the request reaches the backend, and waits ``sync_idle_s`` after the last one."""
        self._sync_seen = self._clock()
        if self.settings.yield_to_sync and self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    async def acquire(self) -> None:
        await self.wait_free()
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        if self.running == 0:  # nothing left to preempt: stop watching
            if self._watcher is not None:
                self._watcher.cancel()
            if self._arrival is not None and not self._arrival.done():
                self._arrival.cancel()
            self._watcher = self._arrival = None


class CapacityGates:
    """One gate per backend, found from the model an item names."""

    def __init__(self, registry: ModelRegistry, settings: BatchSettings) -> None:
        self.registry = registry
        self.settings = settings
        self._gates: dict[str, BackendGate] = {}
        self._fallback = BackendGate(None, settings)

    def for_backend(self, name: str) -> BackendGate:
        gate = self._gates.get(name)
        if gate is None:
            backend = self.registry.generation.get(name)
            probe = backend if _is_probe(backend) else None
            gate = self._gates[name] = BackendGate(probe, self.settings)
        return gate

    def for_model(self, model: str) -> BackendGate:
        info = self.registry.resolve(model)
        return self._fallback if info is None else self.for_backend(info.backend_name)

    def live_request(self, backend: str) -> None:
        """Announce a live request for ``backend`` (see :meth:`BackendGate.live_request`)."""
        gate = self._gates.get(backend)
        if gate is not None:
            gate.live_request()

    def any_free(self) -> bool:
        names = set(self.registry.generation) | set(self.registry.embedding)
        return any(self.for_backend(n).free() for n in names) or not names

    async def wait_any_free(self) -> None:
        while not self.any_free():  # noqa: ASYNC110 (the backend's counters have no event)
            await asyncio.sleep(self.settings.capacity_poll_s)


def _is_probe(backend: object) -> TypeGuard[CapacityProbe]:
    return callable(getattr(backend, "inflight", None)) and callable(
        getattr(backend, "has_capacity", None)
    )
