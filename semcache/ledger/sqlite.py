"""Ledger storage in one SQLite file under the data directory (the default).

The stdlib ``sqlite3`` in a worker thread: one upsert per (day, tenant, model, route) row per
flush, in one transaction. WAL journal with ``synchronous = NORMAL``: a committed flush
survives the process being killed (the operating system has the pages); a power cut may lose
the last commits. Several worker processes may share the file: the upserts add.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from semcache.ledger.base import Batch, LedgerUnavailable, Row, Storage
from semcache.ledger.records import FLOAT_FIELDS, SUM_FIELDS

_COLUMNS = ",\n    ".join(
    f"{f} {'REAL' if f in FLOAT_FIELDS else 'INTEGER'} NOT NULL DEFAULT 0" for f in SUM_FIELDS
)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage (
    day TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    route TEXT NOT NULL,
    {_COLUMNS},
    PRIMARY KEY (day, tenant, model, route)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_by_tenant ON usage (tenant, day);
"""

_UPSERT = (
    f"INSERT INTO usage (day, tenant, model, route, {', '.join(SUM_FIELDS)}) "
    f"VALUES (?, ?, ?, ?, {', '.join('?' for _ in SUM_FIELDS)}) "
    "ON CONFLICT (day, tenant, model, route) DO UPDATE SET "
    + ", ".join(f"{f} = {f} + excluded.{f}" for f in SUM_FIELDS)
)

_SUMS = ", ".join(f"SUM({f})" for f in SUM_FIELDS)


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """A ledger written before a sum was added gets that column, at 0 for its old rows."""
    have = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
    for f in SUM_FIELDS:
        if f not in have:
            kind = "REAL" if f in FLOAT_FIELDS else "INTEGER"
            db.execute(f"ALTER TABLE usage ADD COLUMN {f} {kind} NOT NULL DEFAULT 0")


class SqliteStorage(Storage):
    """Usage rows in ``path`` (created with its directory)."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 5.0) -> None:
        self.path = path
        self.name = f"sqlite {path}"
        self.busy_timeout_s = busy_timeout_s
        self._db: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        """Reads use their own connection: they never see a write's open transaction."""
        self._read_lock = threading.Lock()

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the usage ledger is not started")
        return self._db

    def _connect(self) -> tuple[sqlite3.Connection, sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db, reader = (
            sqlite3.connect(
                self.path,
                timeout=self.busy_timeout_s,
                isolation_level=None,
                check_same_thread=False,
            )
            for _ in range(2)
        )
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.executescript(_SCHEMA)
        _add_missing_columns(db)
        return db, reader

    async def open(self) -> None:
        self._db, self._reader = await asyncio.to_thread(self._connect)

    async def close(self) -> None:
        for conn in (self._db, self._reader):
            if conn is not None:
                await asyncio.to_thread(conn.close)
        self._db = self._reader = None

    def _select(self, sql: str, args: Sequence[object]) -> list[tuple[Any, ...]]:
        if self._reader is None:
            raise RuntimeError("the usage ledger is not started")
        with self._read_lock:
            return self._reader.execute(sql, args).fetchall()

    def _write(self, batches: Sequence[Batch]) -> None:
        db = self.db
        rows = [(*key, *values) for b in batches for key, values in b.counts.rows.items()]
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(_UPSERT, rows)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    async def write(self, batches: Sequence[Batch]) -> None:
        await asyncio.to_thread(self._write, batches)

    def _read(self, start: str, end: str, group_by: Sequence[str], tenant: str | None) -> list[Row]:
        cols = ", ".join(group_by)
        sql = f"SELECT {cols + ', ' if cols else ''}{_SUMS} FROM usage WHERE day BETWEEN ? AND ?"
        args: list[str] = [start, end]
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if cols:
            sql += f" GROUP BY {cols}"
        n = len(group_by)
        rows: list[Row] = []
        for found in self._select(sql, args):
            if found[n] is None:  # no row at all (a sum over nothing)
                continue
            rows.append((dict(zip(group_by, found[:n], strict=True)), found[n:]))
        return rows

    async def read(
        self, start: str, end: str, group_by: Sequence[str], tenant: str | None
    ) -> list[Row]:
        try:
            return await asyncio.to_thread(self._read, start, end, group_by, tenant)
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"{self.name}: {exc}") from exc

    def _read_spend(self, tenant: str, first: str, last: str) -> tuple[int, float, int]:
        ((tokens, usd, saved),) = self._select(
            "SELECT SUM(prompt_tokens + completion_tokens), SUM(cost_usd), SUM(tokens_saved) "
            "FROM usage WHERE tenant = ? AND day BETWEEN ? AND ?",
            (tenant, first, last),
        )
        return int(tokens or 0), float(usd or 0.0), int(saved or 0)

    async def read_spend(self, tenant: str, period_key: str) -> tuple[int, float, int]:
        month = len(period_key) == 7
        first = f"{period_key}-01" if month else period_key
        last = f"{period_key}-31" if month else period_key
        try:
            return await asyncio.to_thread(self._read_spend, tenant, first, last)
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"{self.name}: {exc}") from exc
