"""The pools of this gateway, kept as the stored changes say.

A server added or drained through the admin API is written to the membership store; at start
and after every change (pub/sub on a shared store, and every ``resync_s`` anyway) each stored
change is applied where this gateway's pool differs: a server recorded ``added`` joins when
it is missing, one recorded ``drained`` drains when it serves. A restarted gateway so comes
back with the pools as they were, and every gateway on a shared store serves the same ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from backends.config import ServerRole
from backends.registry import ModelRegistry
from backends.vllm.client import VllmClient
from server.pools.records import MemberChange, MemberState
from server.pools.store import MembershipStore

log = logging.getLogger("semcache.pools")


class PoolMembership:
    def __init__(
        self,
        store: MembershipStore,
        registry: ModelRegistry,
        *,
        resync_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.registry = registry
        self.resync_s = resync_s
        self._clock = clock
        self._lock = asyncio.Lock()  # one sync at a time: two would add one server twice
        self._tasks: list[asyncio.Task[None]] = []
        self.applied = 0
        """Changes this gateway applied from the store (made here or elsewhere)."""

    async def start(self) -> None:
        """Apply what the store holds, then follow it. A store that cannot be read leaves the
        config's pools (logged) and is read again at the next resync."""
        await self.sync()
        self._tasks = [asyncio.create_task(self._resync(), name="pool-membership-resync")]
        if self.store.shared:
            watch = self.store.watch(self.sync)
            self._tasks.append(asyncio.create_task(watch, name="pool-membership-watch"))

    async def record(
        self, backend: str, role: ServerRole, url: str, state: MemberState, max_inflight: int | None
    ) -> None:
        """Keep a change this gateway just made (it raises when the store cannot take it)."""
        change = MemberChange(
            backend=backend,
            role=role,
            url=url.rstrip("/"),
            state=state,
            max_inflight=max_inflight,
            at=self._clock(),
        )
        await self.store.put(change)

    async def sync(self) -> None:
        try:
            changes = await self.store.load_all()
        except Exception as exc:
            log.warning("pool membership store unreadable (%s): pools left as they are", exc)
            return
        # Joins before departures: the last server of a pool may leave once its successor came.
        changes.sort(key=lambda c: (c.state != "added", c.at))
        async with self._lock:
            for change in changes:
                if await self._apply(change):
                    self.applied += 1

    async def _apply(self, change: MemberChange) -> bool:
        client = self.registry.generation.get(change.backend)
        pool = client.pool(change.role) if isinstance(client, VllmClient) else None
        if client is None or pool is None:
            log.warning("pool change for unknown pool %s: skipped", change.key)
            return False
        assert isinstance(client, VllmClient)
        serving = pool.find(change.url) is not None
        try:
            if change.state == "added" and not serving:
                await client.add_server(change.role, change.url, change.max_inflight)
                return True
            if change.state == "drained" and serving:
                client.drain_server(change.role, change.url)
                return True
        except (LookupError, ValueError) as exc:  # draining still, or the last server
            log.warning("pool change %s (%s) not applied yet: %s", change.key, change.state, exc)
        return False

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            await self.sync()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.store.aclose()
