"""The gateway's in-memory view of the key store: what authentication reads.

A request's secret is hashed once and looked up in a dict, so the hot path never waits on
the store. The view follows the store's change feed (Redis pub/sub, or the local file's
modification time), re-reads the whole store every ``resync_s`` in case a message was
lost, and writes the keys' last use back every ``last_used_flush_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from server.identity.api_keys.hashing import KeyHasher
from server.identity.api_keys.records import ApiKey
from server.identity.api_keys.store import KeyStore

log = logging.getLogger("semcache.keys")

Refusal = Literal["revoked", "expired", "rotated"]


@dataclass(frozen=True, slots=True)
class Lookup:
    """The key a secret belongs to, and why it may not be used now (``None``: it may)."""

    key: ApiKey
    refused: Refusal | None


class KeyView:
    def __init__(
        self,
        store: KeyStore,
        hasher: KeyHasher,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        resync_s: float = 30.0,
        last_used_flush_s: float = 5.0,
    ) -> None:
        self.store = store
        self.hasher = hasher
        self.clock = clock
        self.sleep = sleep
        """What the resync and the last-use flush wait on between rounds (a test's clock)."""
        self.resync_s = resync_s
        self.last_used_flush_s = last_used_flush_s
        self._by_id: dict[str, ApiKey] = {}
        self._by_digest: dict[str, tuple[ApiKey, bool]] = {}
        """digest → (key, whether it is the previous secret of a rotation)."""
        self._used: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.following = asyncio.Event()
        """Set the first time the store's change feed has the view read it all: for Redis,
        right after subscribing, so every change from then on reaches the view by message."""

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def keys(self) -> list[ApiKey]:
        return list(self._by_id.values())

    def get(self, key_id: str) -> ApiKey | None:
        return self._by_id.get(key_id)

    def lookup(self, secret: str) -> Lookup | None:
        """The key ``secret`` belongs to; ``None`` when it is no key's. Marks it used."""
        digest = self.hasher.digest(secret)
        found = self._by_digest.get(digest)
        if found is None:
            return None
        key, previous = found
        stored = key.previous_digest if previous else key.digest
        if stored is None or not self.hasher.same(stored, digest):
            return None
        now = self.clock()
        refused: Refusal | None = None
        if key.revoked_at is not None:
            refused = "revoked"
        elif key.expires_at is not None and now >= key.expires_at:
            refused = "expired"
        elif previous and (key.previous_valid_until is None or now >= key.previous_valid_until):
            refused = "rotated"
        else:
            self._used[key.id] = now
        return Lookup(key, refused)

    def apply(self, key: ApiKey) -> None:
        """Index ``key`` (a newer version replaces an older one; an older one is ignored)."""
        old = self._by_id.get(key.id)
        if old is not None:
            if old.version > key.version:
                return
            self._drop(old)
        self._by_id[key.id] = key
        self._by_digest[key.digest] = (key, False)
        if key.previous_digest is not None:
            self._by_digest[key.previous_digest] = (key, True)

    def _drop(self, key: ApiKey) -> None:
        for digest in (key.digest, key.previous_digest):
            if digest is not None and self._by_digest.get(digest, (None,))[0] is key:
                del self._by_digest[digest]

    async def reload(self) -> None:
        """Read the whole store again."""
        keys = await self.store.load_all()
        by_id = {k.id: k for k in keys}
        for old in list(self._by_id.values()):
            if old.id not in by_id:
                self._drop(old)
                del self._by_id[old.id]
        for key in keys:
            current = self._by_id.get(key.id)
            if current is None or current.version <= key.version:
                self.apply(key)

    async def _changed(self, key_id: str | None) -> None:
        if key_id is None:
            await self.reload()
            self.following.set()
            return
        key = await self.store.get(key_id)
        if key is not None:
            self.apply(key)

    def last_used(self, key_id: str) -> float | None:
        return self._used.get(key_id)

    async def flush_used(self) -> None:
        pending, self._used = self._used, {}
        if not pending:
            return
        try:
            await self.store.touch(pending)
        except Exception as exc:
            log.warning("could not record the API keys' last use: %s", exc)
            for key_id, at in pending.items():
                self._used.setdefault(key_id, at)

    async def start(self) -> None:
        await self.reload()
        self._tasks = [
            asyncio.create_task(self._watch(), name="apikeys-watch"),
            asyncio.create_task(self._every(self.resync_s, self.reload), name="apikeys-resync"),
            asyncio.create_task(
                self._every(self.last_used_flush_s, self.flush_used), name="apikeys-used"
            ),
        ]

    async def _watch(self) -> None:
        while True:
            try:
                await self.store.watch(self._changed)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the API key change feed failed; following it again")
                await asyncio.sleep(1.0)

    async def _every(self, seconds: float, work: Callable[[], object]) -> None:
        while True:
            await self.sleep(seconds)
            try:
                result = work()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:
                log.warning("API keys: %s failed: %s", getattr(work, "__name__", work), exc)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.flush_used()
        await self.store.aclose()
