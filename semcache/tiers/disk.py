"""L2: a size-limited ``diskcache`` directory shared by the worker processes of one machine.

diskcache is SQLite plus files and is safe across processes; its calls block, so they run in
a worker thread. Two things keep that thread off the common paths:

* a :class:`~semcache.tiers.keyfilter.KeyFilter` answers most misses without asking SQLite;
* writes are group-committed: the writes that arrive while one batch is being written go
  together into the next transaction (one thread hop and one commit for all of them).

A lock held too long by another process (``diskcache.Timeout``) counts as a miss or a
skipped write rather than an error. A batch that fails to write (a full disk: SQLite's
"database or disk is full", ``ENOSPC``) is rolled back whole and reported to ``on_write``
(the exact cache logs it once and counts every entry not written); the answers stay served
from the memory tier, and nothing half written is ever read back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Self

import diskcache

from semcache.tiers.base import Store
from semcache.tiers.keyfilter import KeyFilter

log = logging.getLogger(__name__)

_Batch = dict[str, tuple[bytes, float | None]]

WriteReport = Callable[[int, Exception | None], None]
"""Called after each batch: how many writes it held, and the error that lost them (or None)."""

MAX_BATCH = 256
"""A batch this large is written at once, without waiting for the linger time."""


class _Backend:
    """One open directory, shared by a store and its namespace views."""

    def __init__(
        self, cache: diskcache.Cache, directory: Path, *, key_filter: bool, linger_s: float
    ) -> None:
        self.cache = cache
        self.linger_s = linger_s
        self._urgent = asyncio.Event()
        self.filter = KeyFilter(cache, directory) if key_filter else None
        self.pending: _Batch = {}
        """Writes waiting for the next batch."""
        self.writing: _Batch = {}
        """The batch being written now."""
        self._pending_done: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self.batches = 0
        """Transactions written so far (for tests and stats)."""
        self.on_write: WriteReport = _log_failed_write

    def unwritten(self, key: str) -> bytes | None:
        item = self.pending.get(key) or self.writing.get(key)
        return item[0] if item is not None else None

    def forget(self, keys: Iterable[str]) -> None:
        """Drop pending writes of ``keys`` (a delete supersedes them)."""
        for k in keys:
            self.pending.pop(k, None)
        if not self.pending and self._pending_done is not None:
            self._pending_done.set_result(None)  # nothing left for their batch to write
            self._pending_done = None

    def enqueue(
        self, key: str, value: bytes, ttl_s: float | None, *, urgent: bool
    ) -> asyncio.Future[None]:
        if self.filter is not None:
            self.filter.add(key)
        self.pending[key] = (value, ttl_s)
        if urgent or len(self.pending) >= MAX_BATCH:
            self._urgent.set()
        if self._pending_done is None:
            self._pending_done = asyncio.get_running_loop().create_future()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_batches())
        return self._pending_done

    async def _linger(self) -> None:
        if self.linger_s > 0 and not self._urgent.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), self.linger_s)
        self._urgent.clear()

    async def _write_batches(self) -> None:
        while self.pending:
            await self._linger()
            if not self.pending:
                break
            batch = self.writing = self.pending
            self.pending = {}
            done, self._pending_done = self._pending_done, None
            try:
                before = await asyncio.to_thread(self._write, self.writing)
            except Exception as exc:  # the waiters see it; later batches still run
                self.on_write(len(batch), exc)
                if done is not None and not done.done():
                    done.set_exception(exc)
                    done.exception()  # retrieved: nobody may be waiting
                continue
            finally:
                self.writing = {}
            self.batches += 1
            self.on_write(len(batch), None)
            if before is not None and self.filter is not None:
                self.filter.wrote(before)
            if done is not None and not done.done():
                done.set_result(None)

    def _write(self, batch: _Batch) -> int | None:
        """One transaction for the batch; the generation before its bump (None: skipped)."""
        try:
            with self.cache.transact(retry=False):
                for key, (value, ttl_s) in batch.items():
                    self.cache.set(key, value, expire=ttl_s, retry=False)
        except diskcache.Timeout:
            log.debug("disk tier busy, %d writes skipped", len(batch))
            return None
        return self.filter.generation.bump() if self.filter is not None else None

    async def drain(self) -> None:
        """Write everything pending now and wait for it."""
        while self._writer is not None and not self._writer.done():
            self._urgent.set()
            await asyncio.shield(self._writer)


def _log_failed_write(n: int, exc: Exception | None) -> None:
    if exc is not None:
        log.warning("disk tier write of %d items failed: %s", n, exc)


class DiskStore(Store[bytes]):
    """Byte store on a ``diskcache.Cache``; ``max_bytes`` bounds the directory's size.

    ``key_filter``: answer misses from an in-memory key set when it is known to be exact
    (see :mod:`semcache.tiers.keyfilter`); off, every lookup asks SQLite. ``linger_s``: how
    long a :meth:`set_behind` write may wait to be batched with others.
    """

    tier = "disk"

    def __init__(
        self,
        directory: str | Path,
        *,
        max_bytes: int = 1024**3,
        eviction: str = "least-recently-stored",
        timeout_s: float = 2.0,
        namespace: str = "",
        key_filter: bool = True,
        linger_s: float = 0.2,
        _backend: _Backend | None = None,
    ) -> None:
        super().__init__(namespace)
        self.directory = Path(directory)
        if _backend is None:
            cache = diskcache.Cache(
                str(self.directory),
                size_limit=max_bytes,
                eviction_policy=eviction,
                timeout=timeout_s,
            )
            _backend = _Backend(cache, self.directory, key_filter=key_filter, linger_s=linger_s)
        self._backend = _backend

    @property
    def cache(self) -> diskcache.Cache:
        return self._backend.cache

    @property
    def key_filter(self) -> KeyFilter | None:
        return self._backend.filter

    def report_writes(self, report: WriteReport) -> None:
        """Tell ``report`` the outcome of every batch written (the store's owner counts)."""
        self._backend.on_write = report

    def _get(self, key: str) -> bytes | None:
        try:
            value = self.cache.get(key, default=None, retry=False)
        except diskcache.Timeout:
            return None
        return value if isinstance(value, bytes) else None

    async def get(self, key: str) -> bytes | None:
        full = self._full(key)
        backend = self._backend
        value = backend.unwritten(full)
        if value is not None:
            return value
        if backend.filter is not None and not backend.filter.may_contain(full):
            return None
        return await asyncio.to_thread(self._get, full)

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Returns once the value is committed (with the writes batched alongside it)."""
        if ttl_s is not None and ttl_s <= 0:
            return
        await asyncio.shield(self._backend.enqueue(self._full(key), value, ttl_s, urgent=True))

    def set_behind(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Write in the background: within ``linger_s``, batched with the writes around it.

        Readable at once from this process; other processes see it once committed.
        """
        if ttl_s is not None and ttl_s <= 0:
            return
        self._backend.enqueue(self._full(key), value, ttl_s, urgent=False)

    async def flush(self) -> None:
        """Commit every write made so far."""
        await self._backend.drain()

    def _delete_many(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self.cache.delete(k, retry=True)
            except diskcache.Timeout:
                log.warning("disk tier busy, delete of %s skipped", k)

    async def delete(self, key: str) -> None:
        await self.delete_many([key])

    async def delete_many(self, keys: Iterable[str]) -> None:
        full = [self._full(k) for k in keys]
        self._backend.forget(full)
        await self._backend.drain()  # a batch in flight must not land after the delete
        await asyncio.to_thread(self._delete_many, full)

    def _clear(self) -> None:
        if not self.namespace:
            self.cache.clear(retry=True)
            return
        prefix = self.namespace + "/"
        self._delete_many([k for k in self.cache.iterkeys() if str(k).startswith(prefix)])

    async def clear(self) -> None:
        backend = self._backend
        prefix = self.namespace + "/" if self.namespace else ""
        backend.forget([k for k in backend.pending if k.startswith(prefix)])
        await backend.drain()
        await asyncio.to_thread(self._clear)

    def with_namespace(self, namespace: str) -> Self:
        return type(self)(self.directory, namespace=self._child(namespace), _backend=self._backend)

    @property
    def volume(self) -> int:
        """Bytes used on disk (blocking; for tests and stats)."""
        return int(self.cache.volume())

    async def aclose(self) -> None:
        await self._backend.drain()
        if self._backend.filter is not None:
            await self._backend.filter.aclose()
        await asyncio.to_thread(self.cache.close)
