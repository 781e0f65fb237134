"""The embedded batch queue: SQLite on local disk, durable across crashes of the gateway.

Every change is one SQLite transaction in WAL mode with ``synchronous=FULL``: a submitted
batch and every stored result survive ``kill -9`` (and a power cut). Items live in ``items``
until their result is stored in ``results``; a claim is a lease (``leased_by``,
``lease_until``) that expires unless renewed, so the items of a killed worker are claimed
again. ``results`` has the primary key ``(job_id, idx)`` and is written with
``INSERT OR IGNORE``: an item that ran twice still has one result. A job's ``traceparent``
(the submitter's trace context) is a column added to files made before it existed, so an
old queue loads and its jobs have none.

Several gateway processes on one machine may share the file (SQLite locks it); all calls of
one process go through a single thread that owns the connection.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from server.batch.queue.base import ItemResult, JobState, QueueDepth, WorkItem

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    started INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    finished_at REAL,
    traceparent TEXT
);
CREATE TABLE IF NOT EXISTS items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    payload BLOB NOT NULL,
    leased_by TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    UNIQUE (job_id, idx)
);
CREATE INDEX IF NOT EXISTS items_due ON items (lease_until, seq);
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (job_id, idx)
) WITHOUT ROWID;
"""


def _add_trace_column(db: sqlite3.Connection) -> None:
    """Give a jobs table made before jobs kept a trace context its ``traceparent`` column
    (in a write transaction: two processes opening one old file add it once)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    if "traceparent" not in columns:
        db.execute("ALTER TABLE jobs ADD COLUMN traceparent TEXT")


class DiskQueue:
    """A `BatchQueue` in one SQLite file; build it with :meth:`open`."""

    def __init__(
        self,
        path: Path,
        *,
        lease_s: float = 30.0,
        results_ttl_s: float = 86400.0,
        max_age_s: float = 7 * 86400.0,
        poll_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.lease_s = lease_s
        self.results_ttl_s = results_ttl_s
        self.max_age_s = max_age_s
        self.poll_s = poll_s
        """How often a waiting ``claim`` looks for work another process submitted (work of this
        process wakes it at once)."""
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semcache-queue")
        self._db: sqlite3.Connection | None = None
        self._wakeup = asyncio.Event()

    @classmethod
    async def open(cls, path: Path, **kwargs: Any) -> DiskQueue:
        queue = cls(path, **kwargs)
        await queue._call(queue._connect)
        return queue

    # -- plumbing -------------------------------------------------------------------

    def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        self._db = db
        self._tx(_add_trace_column)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one write transaction (taken at once, so writers never deadlock)."""
        db = self._db
        assert db is not None, "DiskQueue used before open()"
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return out

    def _read(self) -> sqlite3.Connection:
        assert self._db is not None, "DiskQueue used before open()"
        return self._db

    # -- BatchQueue -----------------------------------------------------------------

    async def depth(self) -> QueueDepth:
        now = self._clock()

        def run() -> QueueDepth:
            items, leased, oldest = (
                self._read()
                .execute(
                    "SELECT count(*), coalesce(sum(leased_by IS NOT NULL AND lease_until > ?), 0), "
                    "min(jobs.created_at) "
                    "FROM items JOIN jobs ON jobs.id = items.job_id",
                    (now,),
                )
                .fetchone()
            )
            age = None if oldest is None else max(now - oldest, 0.0)
            return QueueDepth(items=items, leased=leased, oldest_age_s=age)

        return await self._call(run)

    async def submit(
        self,
        job_id: str,
        tenant: str,
        model: str,
        payloads: Sequence[bytes],
        *,
        trace_context: str | None = None,
    ) -> None:
        now = self._clock()
        rows = [(job_id, i, p) for i, p in enumerate(payloads)]

        def run(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO jobs (id, tenant, model, total, created_at, traceparent) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, tenant, model, len(rows), now, trace_context),
            )
            db.executemany("INSERT INTO items (job_id, idx, payload) VALUES (?, ?, ?)", rows)

        await self._call(self._tx, run)
        self._wakeup.set()

    def _claim(self, consumer: str, limit: int) -> list[WorkItem]:
        now = self._clock()

        def run(db: sqlite3.Connection) -> list[WorkItem]:
            rows = db.execute(
                "SELECT i.seq, i.job_id, i.idx, i.payload, i.attempts, j.tenant, j.model, "
                "j.traceparent "
                "FROM items i JOIN jobs j ON j.id = i.job_id "
                "WHERE i.lease_until <= ? ORDER BY i.seq LIMIT ?",
                (now, limit),
            ).fetchall()
            if not rows:
                return []
            until = now + self.lease_s
            db.executemany(
                "UPDATE items SET leased_by = ?, lease_until = ?, attempts = attempts + 1 "
                "WHERE seq = ?",
                [(consumer, until, r[0]) for r in rows],
            )
            db.executemany(
                "UPDATE jobs SET started = 1 WHERE id = ? AND started = 0",
                [(job,) for job in {r[1] for r in rows}],
            )
            return [
                WorkItem(
                    job_id=r[1],
                    index=r[2],
                    payload=bytes(r[3]),
                    attempts=r[4] + 1,
                    tenant=r[5],
                    model=r[6],
                    receipt=str(r[0]),
                    trace_context=r[7],
                )
                for r in rows
            ]

        return self._tx(run)

    def _next_due(self) -> float | None:
        """When the earliest item given back with a delay, or leased, becomes claimable."""
        row = self._read().execute("SELECT MIN(lease_until) FROM items").fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def _claim_or_due(self, consumer: str, limit: int) -> tuple[list[WorkItem], float | None]:
        items = self._claim(consumer, limit)
        return items, (None if items else self._next_due())

    async def claim(self, consumer: str, limit: int, wait_s: float) -> list[WorkItem]:
        """Claim, or sleep until a submission or retry in this process (an event), the next
        lease or retry delay running out, or ``poll_s`` (submissions of other processes
        sharing the file): an idle queue costs no CPU."""
        deadline = time.monotonic() + wait_s
        while True:
            self._wakeup.clear()
            items, due = await self._call(self._claim_or_due, consumer, limit)
            remaining = deadline - time.monotonic()
            if items or remaining <= 0:
                return items
            timeout = min(self.poll_s, remaining)
            if due is not None:
                timeout = min(timeout, max(0.0, due - self._clock()) + 0.001)
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass

    async def extend(self, consumer: str, items: Sequence[WorkItem]) -> None:
        if not items:
            return
        until = self._clock() + self.lease_s
        rows = [(until, int(item.receipt), consumer) for item in items]

        def run(db: sqlite3.Connection) -> None:
            db.executemany("UPDATE items SET lease_until = ? WHERE seq = ? AND leased_by = ?", rows)

        await self._call(self._tx, run)

    async def complete(self, item: WorkItem, body: bytes) -> bool:
        now = self._clock()

        def run(db: sqlite3.Connection) -> bool:
            db.execute("DELETE FROM items WHERE job_id = ? AND idx = ?", (item.job_id, item.index))
            if db.execute("SELECT 1 FROM jobs WHERE id = ?", (item.job_id,)).fetchone() is None:
                return False  # the job expired or was removed meanwhile
            cur = db.execute(
                "INSERT OR IGNORE INTO results (job_id, idx, body) VALUES (?, ?, ?)",
                (item.job_id, item.index, body),
            )
            if cur.rowcount != 1:
                return False
            db.execute(
                "UPDATE jobs SET completed = completed + 1, finished_at = CASE "
                "WHEN completed + 1 >= total THEN ? ELSE finished_at END WHERE id = ?",
                (now, item.job_id),
            )
            return True

        return await self._call(self._tx, run)

    async def retry(self, item: WorkItem, delay_s: float) -> None:
        when = self._clock() + max(0.0, delay_s)

        def run(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE items SET leased_by = NULL, lease_until = ? "
                "WHERE seq = ? AND job_id = ? AND idx = ?",
                (when, int(item.receipt), item.job_id, item.index),
            )

        await self._call(self._tx, run)
        self._wakeup.set()

    def _job(self, job_id: str) -> JobState | None:
        row = (
            self._read()
            .execute(
                "SELECT tenant, model, total, completed, started, created_at, finished_at "
                "FROM jobs WHERE id = ?",
                (job_id,),
            )
            .fetchone()
        )
        if row is None:
            return None
        state = JobState(
            id=job_id,
            tenant=row[0],
            model=row[1],
            total=row[2],
            completed=row[3],
            started=bool(row[4]),
            created_at=row[5],
            finished_at=row[6],
        )
        return None if self._expired(state, self._clock()) else state

    def _expired(self, state: JobState, now: float) -> bool:
        if state.finished_at is not None:
            return state.finished_at + self.results_ttl_s <= now
        return state.created_at + self.max_age_s <= now

    async def job(self, job_id: str) -> JobState | None:
        return await self._call(self._job, job_id)

    def _results(self, job_id: str) -> list[ItemResult]:
        rows = (
            self._read()
            .execute("SELECT idx, body FROM results WHERE job_id = ? ORDER BY idx", (job_id,))
            .fetchall()
        )
        return [ItemResult(index=r[0], body=bytes(r[1])) for r in rows]

    async def results(self, job_id: str) -> list[ItemResult]:
        return await self._call(self._results, job_id)

    async def purge_expired(self) -> int:
        now = self._clock()

        def run(db: sqlite3.Connection) -> int:
            ids = [
                (r[0],)
                for r in db.execute(
                    "SELECT id FROM jobs WHERE (finished_at IS NOT NULL AND finished_at <= ?) "
                    "OR (finished_at IS NULL AND created_at <= ?)",
                    (now - self.results_ttl_s, now - self.max_age_s),
                ).fetchall()
            ]
            db.executemany("DELETE FROM items WHERE job_id = ?", ids)
            db.executemany("DELETE FROM results WHERE job_id = ?", ids)
            db.executemany("DELETE FROM jobs WHERE id = ?", ids)
            return len(ids)

        return await self._call(self._tx, run)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    async def aclose(self) -> None:
        await self._call(self._close)
        self._executor.shutdown(wait=True)
