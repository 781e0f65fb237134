"""The ledger every gateway keeps: records summed in memory, written in batches off the path.

:class:`BufferedLedger` does what is common to every storage: :meth:`~BufferedLedger.add`
only adds numbers to a dictionary; a background task hands the sums to the storage every
``flush_interval_s``; queries and budget checks add what is not written yet to what is. A
storage that cannot take a batch (Redis down, SQLite locked) keeps it for the next flush, so
an outage delays the counts but neither loses nor doubles them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol

from semcache.ledger.records import (
    Counts,
    Spend,
    UsageRecord,
    check_query,
    group_rows,
    spend_values,
    utc_day,
    utc_month,
)

log = logging.getLogger(__name__)

Period = Literal["day", "month"]
Row = tuple[Mapping[str, str], Sequence[float]]
"""A stored row: its key fields (those asked for) and its sums (``SUM_FIELDS`` order)."""


class LedgerUnavailable(Exception):
    """The storage cannot be read now (Redis down); the message says why."""


class UsageLedger(Protocol):
    """Usage and cost per (tenant, model, route, UTC day); one per app."""

    def add(self, record: UsageRecord) -> None:
        """Count one record. Synchronous and O(1): nothing is written here."""

    async def flush(self) -> None:
        """Write what was added so far (the background task calls this every interval)."""

    async def query(
        self, start: str, end: str, group_by: Sequence[str], tenant: str | None
    ) -> list[dict[str, object]]:
        """Sums of every numeric field from ``start`` to ``end`` (UTC days, both included),
        grouped by ``group_by`` (any of tenant, model, route, day; the others are omitted),
        for one tenant or all; records not written yet are included.

        Raises ``ValueError`` on bad arguments and :class:`LedgerUnavailable`.
        """
        ...

    async def spent(self, tenant: str, period: Period, now: float) -> Spend:
        """The tenant's usage in the UTC day or month of ``now``, unwritten records included.

        Cheap: stored totals are cached per tenant and period and re-read in the background
        at most every ``spent_refresh_s``.
        """
        ...

    async def start(self) -> None:
        """Open the storage and start the background writer."""

    async def aclose(self) -> None:
        """Stop the writer, write everything, close the storage."""


class Batch:
    """Sums handed to the storage together; the id lets Redis apply a retried batch once."""

    __slots__ = ("attempted", "counts", "id")

    def __init__(self, counts: Counts) -> None:
        self.id = uuid.uuid4().hex
        self.counts = counts
        self.attempted = False
        """Set by a storage that sent the batch without learning whether it was applied
        (a timeout): the batch is then retried as it is, never merged with newer sums."""


class Storage(ABC):
    """Where a :class:`BufferedLedger` writes and reads its sums."""

    name: str = "storage"

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def write(self, batches: Sequence[Batch]) -> None:
        """Add the batches to the stored sums, all or none; raise when they were not written."""

    @abstractmethod
    async def read(
        self, start: str, end: str, group_by: Sequence[str], tenant: str | None
    ) -> list[Row]:
        """Stored rows of the days from ``start`` to ``end``; may be pre-grouped by
        ``group_by``. Raises :class:`LedgerUnavailable`."""

    @abstractmethod
    async def read_spend(self, tenant: str, period_key: str) -> tuple[int, float, int]:
        """Stored (tokens, cost_usd, tokens_saved) of a tenant in a day ``YYYY-MM-DD`` or a
        month ``YYYY-MM``. Raises :class:`LedgerUnavailable`."""


class _Stored:
    __slots__ = ("at", "values")

    def __init__(self, values: Sequence[float], at: float) -> None:
        self.values = list(values)
        self.at = at


class BufferedLedger:
    """A :class:`UsageLedger` over a :class:`Storage`."""

    def __init__(
        self,
        storage: Storage,
        *,
        flush_interval_s: float = 1.0,
        spent_refresh_s: float = 1.0,
        clock: Callable[[], float],
    ) -> None:
        self.storage = storage
        self.flush_interval_s = flush_interval_s
        self.spent_refresh_s = spent_refresh_s
        self.clock = clock
        self._pending = Counts()
        self._unsent: list[Batch] = []
        """Batches taken from ``_pending`` that are not written yet (being written, or kept
        after a failed write), oldest first."""
        self._unwritten: dict[str, dict[str, list[float]]] = {}
        """tenant → day → [tokens, usd, tokens_saved] of everything not written yet."""
        self._stored: dict[tuple[str, str], _Stored] = {}
        """(tenant, day or month) → stored totals as last read, plus what this ledger wrote
        since."""
        self._lock = asyncio.Lock()
        self._writes = 0
        """Odd while a write is in progress; a spend read that saw it change is discarded."""
        self._refreshing: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._failing = False
        self.failed_flushes = 0

    # ------------------------------------------------------------------ counting

    def add(self, record: UsageRecord) -> None:
        values = record.values()
        self._pending.add(record.key, values)
        days = self._unwritten.setdefault(record.tenant, {})
        acc = days.get(record.day)
        spend = spend_values(values)
        if acc is None:
            days[record.day] = list(spend)
        else:
            for i, v in enumerate(spend):
                acc[i] += v

    def _written(self, batch: Batch, *, retried: bool) -> None:
        """Move a written batch's sums from "unwritten" to the cached stored totals."""
        for key, values in batch.counts.rows.items():
            day, tenant = key[0], key[1]
            spend = spend_values(values)
            days = self._unwritten.get(tenant)
            if days is not None and day in days:
                acc = days[day]
                for i, v in enumerate(spend):
                    acc[i] -= v
                if acc[0] == 0 and abs(acc[1]) < 1e-12 and acc[2] == 0:
                    del days[day]
                    if not days:
                        del self._unwritten[tenant]
            for period_key in (day, day[:7]):
                stored = self._stored.get((tenant, period_key))
                if stored is None:
                    continue
                if retried:  # a stored read may already hold it: read again
                    del self._stored[(tenant, period_key)]
                else:
                    for i, v in enumerate(spend):
                        stored.values[i] += v

    # ------------------------------------------------------------------ writing

    async def flush(self) -> None:
        async with self._lock:
            if self._pending:
                last = self._unsent[-1] if self._unsent else None
                if last is not None and not last.attempted:
                    last.counts.merge(self._pending)
                else:
                    self._unsent.append(Batch(self._pending))
                self._pending = Counts()
            if not self._unsent:
                return
            batches = list(self._unsent)
            retried = {b.id for b in batches if b.attempted}
            self._writes += 1
            # The write runs to its end even when this task is cancelled: a write that
            # committed but was not accounted for would be written again by the next flush.
            write = asyncio.ensure_future(self.storage.write(batches))
            cancelled = False
            while not write.done():
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    cancelled = True
                except Exception:
                    break
            self._writes += 1
            exc = write.exception()
            if exc is not None:
                self.failed_flushes += 1
                if not self._failing:
                    self._failing = True
                    log.warning(
                        "usage ledger: cannot write %d row(s) to %s (%s: %s); keeping them "
                        "in memory and retrying every %.1fs",
                        sum(len(b.counts) for b in batches),
                        self.storage.name,
                        type(exc).__name__,
                        exc,
                        self.flush_interval_s,
                    )
            else:
                self._account(batches, retried)
            if cancelled:
                raise asyncio.CancelledError

    def _account(self, batches: list[Batch], retried: set[str]) -> None:
        if self._failing:
            self._failing = False
            log.warning("usage ledger: %s takes writes again", self.storage.name)
        del self._unsent[: len(batches)]
        for b in batches:
            self._written(b, retried=b.id in retried)

    async def _flush_every_interval(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.flush_interval_s)
            try:
                await self.flush()
            except Exception:
                log.exception("usage ledger: flush failed")

    # ------------------------------------------------------------------ reading

    def _unwritten_rows(self, start: str, end: str, tenant: str | None) -> list[Row]:
        mem = Counts()
        for b in self._unsent:
            mem.merge(b.counts)
        mem.merge(self._pending)
        rows: list[Row] = []
        for (day, t, model, route), values in mem.rows.items():
            if start <= day <= end and (tenant is None or t == tenant):
                rows.append(({"day": day, "tenant": t, "model": model, "route": route}, values))
        return rows

    async def query(
        self, start: str, end: str, group_by: Sequence[str], tenant: str | None
    ) -> list[dict[str, object]]:
        fields = check_query(start, end, group_by)
        async with self._lock:  # no write between the stored read and the unwritten snapshot
            stored = await self.storage.read(start, end, fields, tenant)
            unwritten = self._unwritten_rows(start, end, tenant)
        return group_rows([*stored, *unwritten], fields)

    async def spent(self, tenant: str, period: Period, now: float) -> Spend:
        period_key = utc_day(now) if period == "day" else utc_month(now)
        key = (tenant, period_key)
        stored = self._stored.get(key)
        if stored is None:
            await asyncio.shield(self._refresh_task(key))
            stored = self._stored.get(key)
        elif self.clock() - stored.at >= self.spent_refresh_s:
            self._refresh_task(key)  # in the background; this call uses the cached totals
        tokens, usd, saved = stored.values if stored is not None else (0, 0.0, 0)
        for day, values in self._unwritten.get(tenant, {}).items():
            if day == period_key or day[:7] == period_key:
                tokens += values[0]
                usd += values[1]
                saved += values[2]
        return Spend(int(tokens), float(usd), int(saved))

    def _refresh_task(self, key: tuple[str, str]) -> asyncio.Task[None]:
        task = self._refreshing.get(key)
        if task is None:
            task = asyncio.create_task(self._refresh(key), name="usage-ledger-spent")
            self._refreshing[key] = task
            task.add_done_callback(lambda _: self._refreshing.pop(key, None))
        return task

    async def _refresh(self, key: tuple[str, str]) -> None:
        tenant, period_key = key
        try:
            for _ in range(2):  # without the lock, unless a write keeps overlapping the read
                before = self._writes
                if before % 2 == 0:
                    values = await self.storage.read_spend(tenant, period_key)
                    if self._writes == before:
                        self._set_stored(key, values)
                        return
                await asyncio.sleep(0)
            async with self._lock:
                self._set_stored(key, await self.storage.read_spend(tenant, period_key))
        except Exception as exc:  # an outage: keep the old totals, try again later
            old = self._stored.get(key)
            if old is None:
                log.warning("usage ledger: cannot read the totals of a tenant: %s", exc)
            self._set_stored(key, old.values if old is not None else (0, 0.0, 0))

    def _set_stored(self, key: tuple[str, str], values: Sequence[float]) -> None:
        if len(self._stored) > 4096:  # totals of past days and months are not asked again
            current = {k for k in self._stored if k[1] in (key[1], key[1][:7])}
            self._stored = {k: v for k, v in self._stored.items() if k in current}
        self._stored[key] = _Stored(values, self.clock())

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        await self.storage.open()
        self._stop.clear()
        self._flusher = asyncio.create_task(self._flush_every_interval(), name="usage-ledger-flush")

    async def aclose(self) -> None:
        refreshing = list(self._refreshing.values())
        for task in refreshing:
            task.cancel()
        await asyncio.gather(*refreshing, return_exceptions=True)
        self._stop.set()  # the writer ends after one last flush
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        await self.flush()
        if self._unsent:
            rows = sum(len(b.counts) for b in self._unsent)
            requests = sum(int(v[0]) for b in self._unsent for v in b.counts.rows.values())
            log.error(
                "usage ledger: %s is unreachable at shutdown; %d row(s) (%d request(s)) of "
                "usage are lost",
                self.storage.name,
                rows,
                requests,
            )
        await self.storage.close()


class NullLedger:
    """The ledger of a gateway with ``[ledger] enabled = false``: counts nothing."""

    def add(self, record: UsageRecord) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def query(
        self, start: str, end: str, group_by: Sequence[str], tenant: str | None
    ) -> list[dict[str, object]]:
        check_query(start, end, group_by)
        return []

    async def spent(self, tenant: str, period: Period, now: float) -> Spend:
        return Spend(0, 0.0, 0)

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass
