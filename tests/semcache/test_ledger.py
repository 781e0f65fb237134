"""The usage ledger on its default storage (SQLite): sums, queries, budgets, durability."""

from __future__ import annotations

import asyncio
import calendar
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from semcache.ledger import (
    SUM_FIELDS,
    BufferedLedger,
    LedgerSettings,
    NullLedger,
    Spend,
    UsageLedger,
    UsageRecord,
    open_ledger,
    utc_day,
)
from semcache.ledger.redis import RedisStorage
from semcache.ledger.sqlite import SqliteStorage
from tests.support.stepped_clock import SteppedClock
from tests.support.waiting import wait_until_async

ROOT = Path(__file__).resolve().parents[2]


def at(day: str, hour: int = 12) -> float:
    """Unix time of ``hour`` o'clock UTC on ``day``."""
    return calendar.timegm(time.strptime(f"{day} {hour}", "%Y-%m-%d %H"))


def record(tenant: str, model: str, route: str, day: str, **fields: int | float) -> UsageRecord:
    return UsageRecord(tenant=tenant, model=model, route=route, day=day, **fields)  # type: ignore[arg-type]


def sqlite_ledger(data_dir: Path, clock: Callable[[], float], **settings: object) -> UsageLedger:
    return open_ledger(
        LedgerSettings(**settings),  # type: ignore[arg-type]
        data_dir=data_dir,
        redis_url=None,
        redis_prefix="semcache",
        clock=clock,
    )


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[UsageLedger]:
    led = sqlite_ledger(tmp_path, SteppedClock(at("2026-12-02")))
    await led.start()
    yield led
    await led.aclose()


RECORDS = [
    record("acme", "llama", "chat", "2026-12-01", prompt_tokens=10, completion_tokens=5),
    record("acme", "llama", "chat", "2026-12-01", prompt_tokens=7, completion_tokens=3),
    record("acme", "llama", "chat", "2026-12-02", prompt_tokens=1, exact_hits=1, tokens_saved=1),
    record("acme", "minilm", "embeddings", "2026-12-02", prompt_tokens=4, semantic_hits=1),
    record("beta", "llama", "completions", "2026-12-02", prompt_tokens=2, completion_tokens=8),
    record("beta", "llama", "chat", "2026-11-30", prompt_tokens=100, cost_usd=0.5),
]


async def test_query_groups_and_sums_written_and_unwritten_alike(ledger: UsageLedger) -> None:
    for r in RECORDS[:3]:
        ledger.add(r)
    await ledger.flush()
    for r in RECORDS[3:]:
        ledger.add(r)  # not written yet: a query counts them all the same

    for flushed in (False, True):
        if flushed:
            await ledger.flush()
        rows = await ledger.query("2026-12-01", "2026-12-31", ["tenant", "day"], None)
        assert rows == [
            {
                "tenant": "acme",
                "day": "2026-12-01",
                "requests": 2,
                "prompt_tokens": 17,
                "completion_tokens": 8,
                "exact_hits": 0,
                "semantic_hits": 0,
                "tokens_saved": 0,
                "cost_usd": 0.0,
                "saved_usd": 0.0,
                "prefix_cached_tokens": 0,
                "prefix_saved_usd": 0.0,
            },
            {
                "tenant": "acme",
                "day": "2026-12-02",
                "requests": 2,
                "prompt_tokens": 5,
                "completion_tokens": 0,
                "exact_hits": 1,
                "semantic_hits": 1,
                "tokens_saved": 1,
                "cost_usd": 0.0,
                "saved_usd": 0.0,
                "prefix_cached_tokens": 0,
                "prefix_saved_usd": 0.0,
            },
            {
                "tenant": "beta",
                "day": "2026-12-02",
                "requests": 1,
                "prompt_tokens": 2,
                "completion_tokens": 8,
                "exact_hits": 0,
                "semantic_hits": 0,
                "tokens_saved": 0,
                "cost_usd": 0.0,
                "saved_usd": 0.0,
                "prefix_cached_tokens": 0,
                "prefix_saved_usd": 0.0,
            },
        ]
        # Group-by order does not matter; key fields come out tenant, model, route, day.
        by_model = await ledger.query("2026-11-01", "2026-12-31", ["route", "model"], None)
        assert [(r["model"], r["route"], r["requests"]) for r in by_model] == [
            ("llama", "chat", 4),
            ("llama", "completions", 1),
            ("minilm", "embeddings", 1),
        ]
        assert all("tenant" not in r and "day" not in r for r in by_model)
        (everything,) = await ledger.query("2026-01-01", "2026-12-31", [], None)
        assert everything["requests"] == 6 and everything["prompt_tokens"] == 124
        assert everything["cost_usd"] == pytest.approx(0.5)
        (beta,) = await ledger.query("2026-11-30", "2026-11-30", ["model"], "beta")
        assert beta["model"] == "llama" and "tenant" not in beta
        assert (beta["requests"], beta["prompt_tokens"], beta["cost_usd"]) == (1, 100, 0.5)
        assert await ledger.query("2026-11-30", "2026-11-30", ["model"], "acme") == []
        assert await ledger.query("2026-10-01", "2026-10-31", ["day"], None) == []


async def test_query_rejects_bad_arguments(ledger: UsageLedger) -> None:
    with pytest.raises(ValueError, match="start: expected a date YYYY-MM-DD"):
        await ledger.query("yesterday", "2026-12-01", [], None)
    with pytest.raises(ValueError, match="end: '2026-02-30' is not a date"):
        await ledger.query("2026-02-01", "2026-02-30", [], None)
    with pytest.raises(ValueError, match="start: a query spans at most 3660 days"):
        await ledger.query("0001-01-01", "9999-12-31", [], None)
    with pytest.raises(ValueError, match="is after end"):
        await ledger.query("2026-12-02", "2026-12-01", [], None)
    with pytest.raises(ValueError, match=r"group_by: unknown field.*'week'"):
        await ledger.query("2026-12-01", "2026-12-01", ["week"], None)


def test_utc_day_turns_at_midnight_utc() -> None:
    assert utc_day(at("2026-12-31", 23) + 3599) == "2026-12-31"
    assert utc_day(at("2026-12-31", 23) + 3600) == "2027-01-01"


async def test_spent_by_day_and_month_with_an_injected_clock(tmp_path: Path) -> None:
    clock = SteppedClock(at("2026-12-02"))
    ledger = sqlite_ledger(tmp_path, clock, spent_refresh_s=1.0)
    other = sqlite_ledger(tmp_path, clock)  # a second worker process on the same file
    await ledger.start()
    await other.start()
    try:
        for r in RECORDS:
            ledger.add(r)
        ledger.add(
            record("acme", "llama", "chat", "2026-12-02", completion_tokens=10, cost_usd=0.25)
        )
        dec2 = at("2026-12-02", 9)
        expect_day = Spend(15, 0.25, 1)  # 2026-12-02: 1 + 4 + 10 tokens, 1 of them from the cache
        expect_month = Spend(15 + 25, 0.25, 1)  # and 2026-12-01's 25
        assert await ledger.spent("acme", "day", dec2) == expect_day
        assert await ledger.spent("acme", "month", dec2) == expect_month
        assert await ledger.spent("beta", "day", dec2) == Spend(10, 0.0, 0)
        assert await ledger.spent("beta", "month", at("2026-11-30")) == Spend(100, 0.5, 0)
        assert await ledger.spent("nobody", "month", dec2) == Spend(0, 0.0, 0)
        await ledger.flush()  # written: counted once, from the stored totals
        assert await ledger.spent("acme", "day", dec2) == expect_day
        assert await ledger.spent("acme", "month", dec2) == expect_month
        ledger.add(record("acme", "llama", "chat", "2026-12-02", prompt_tokens=5, cost_usd=0.01))
        assert (await ledger.spent("acme", "day", dec2)).tokens == 20  # unwritten: at once

        # What another process writes is seen once the cached totals are older than 1 s.
        other.add(record("acme", "llama", "chat", "2026-12-02", prompt_tokens=1000))
        await other.flush()
        assert (await ledger.spent("acme", "day", dec2)).tokens == 20
        clock.now += 1.0
        assert (await ledger.spent("acme", "day", dec2)).tokens == 20  # refresh in background

        async def refreshed() -> bool:
            return (await ledger.spent("acme", "day", dec2)).tokens == 1020

        await wait_until_async(refreshed, timeout_s=5)
        # The next day and month start from zero.
        assert await ledger.spent("acme", "day", at("2026-12-03")) == Spend(0, 0.0, 0)
        assert (await ledger.spent("acme", "month", at("2027-01-01"))).tokens == 0
    finally:
        await other.aclose()
        await ledger.aclose()


async def test_aclose_writes_everything(tmp_path: Path) -> None:
    clock = SteppedClock(at("2026-12-02"))
    ledger = sqlite_ledger(tmp_path, clock, flush_interval_s=3600.0)  # only aclose writes
    await ledger.start()
    for i in range(500):
        ledger.add(
            record(f"t{i % 7}", "llama", "chat", "2026-12-02", prompt_tokens=i, cost_usd=0.001)
        )
    await ledger.aclose()
    assert (tmp_path / "usage.sqlite3").is_file()

    reopened = sqlite_ledger(tmp_path, clock)
    await reopened.start()
    try:
        (row,) = await reopened.query("2026-12-02", "2026-12-02", [], None)
        assert row["requests"] == 500
        assert row["prompt_tokens"] == sum(range(500))
        assert row["cost_usd"] == pytest.approx(0.5)
        assert len(await reopened.query("2026-12-02", "2026-12-02", ["tenant"], None)) == 7
    finally:
        await reopened.aclose()


def test_open_ledger_picks_the_storage(tmp_path: Path) -> None:
    def build(redis_url: str | None, **settings: object) -> UsageLedger:
        return open_ledger(
            LedgerSettings(**settings),  # type: ignore[arg-type]
            data_dir=tmp_path,
            redis_url=redis_url,
            redis_prefix="p",
            clock=time.time,
        )

    auto = build(None)
    assert isinstance(auto, BufferedLedger) and isinstance(auto.storage, SqliteStorage)
    assert auto.storage.path == tmp_path / "usage.sqlite3"
    shared = build("redis://127.0.0.1:1/0")
    assert isinstance(shared, BufferedLedger) and isinstance(shared.storage, RedisStorage)
    assert shared.storage.base == "{p:usage}"
    local = build("redis://127.0.0.1:1/0", storage="sqlite", path="ledger/u.db")
    assert isinstance(local, BufferedLedger) and isinstance(local.storage, SqliteStorage)
    assert local.storage.path == tmp_path / "ledger" / "u.db"
    assert isinstance(build(None, enabled=False), NullLedger)
    with pytest.raises(ValueError, match=r"needs a Redis: set the policy's \[tiers.redis\] url"):
        build(None, storage="redis")


# ------------------------------------------------------------------ kill -9

FLUSH_INTERVAL_S = 1.0
"""The default flush interval: what a kill -9 may lose, plus the write in progress."""
WRITE_SLACK_S = 0.5
"""Time a flush may take on a busy CI machine (a SQLite upsert of one row takes well under)."""

CHILD = """
import asyncio, sys, time
from pathlib import Path
from semcache.ledger import LedgerSettings, UsageRecord, open_ledger

async def main() -> None:
    ledger = open_ledger(
        LedgerSettings(flush_interval_s=float(sys.argv[2])), data_dir=Path(sys.argv[1]),
        redis_url=None, redis_prefix="semcache", clock=time.time,
    )
    await ledger.start()
    n = 0
    while True:
        ledger.add(UsageRecord(tenant="t", model="m", route="chat", day="2026-12-02",
                               prompt_tokens=3))
        n += 1
        print(n, time.monotonic(), flush=True)
        await asyncio.sleep(0.002)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_kill_9_loses_at_most_the_last_flush_interval(tmp_path: Path) -> None:
    """A process killed with SIGKILL loses the records of at most its last 1 s (+ 0.5 s slack).

    The child adds one record every few milliseconds and prints (count, time) after each;
    every record added more than FLUSH_INTERVAL_S + WRITE_SLACK_S before its last printed
    line must be in the file, and nothing more than it added.
    """
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(tmp_path),
        str(FLUSH_INTERVAL_S),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.stdout is not None
    added: list[tuple[int, float]] = []
    try:
        while not added or added[-1][1] - added[0][1] < 3.5 * FLUSH_INTERVAL_S:
            line = await child.stdout.readline()
            assert line, "the child ended early"
            n, t = line.split()
            added.append((int(n), float(t)))
    finally:
        child.send_signal(signal.SIGKILL)
        rest = await child.stdout.read()
        await child.wait()
    assert child.returncode == -signal.SIGKILL
    for line in rest.splitlines():
        n, t = line.split()
        added.append((int(n), float(t)))
    last_n, last_t = added[-1]

    ledger = sqlite_ledger(tmp_path, time.time)
    await ledger.start()
    try:
        rows = await ledger.query("2026-12-02", "2026-12-02", [], None)
    finally:
        await ledger.aclose()
    stored = int(rows[0]["requests"]) if rows else 0  # type: ignore[call-overload]
    must_have = max(
        (n for n, t in added if t <= last_t - FLUSH_INTERVAL_S - WRITE_SLACK_S), default=0
    )
    assert must_have > 0, "the child ran too briefly to prove anything"
    assert must_have <= stored <= last_n, (must_have, stored, last_n)
    assert rows[0]["prompt_tokens"] == 3 * stored  # whole records only


def test_record_values_follow_the_storage_order() -> None:
    r = UsageRecord(
        tenant="t",
        model="m",
        route="r",
        day="2026-12-01",
        **{f: i + 2 for i, f in enumerate(SUM_FIELDS)},
    )
    assert r.values() == [getattr(r, f) for f in SUM_FIELDS] == list(range(2, 2 + len(SUM_FIELDS)))


async def test_a_ledger_written_before_the_prefix_sums_gains_their_columns(
    tmp_path: Path,
) -> None:
    """An SQLite ledger made before ``prefix_cached_tokens`` and ``prefix_saved_usd`` existed
    opens with them added, its old rows at 0, and is written and read as any other."""

    path = tmp_path / "usage.sqlite"
    old = sqlite3.connect(path)
    old.executescript(
        """CREATE TABLE usage (day TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
        route TEXT NOT NULL, requests INTEGER NOT NULL DEFAULT 0,
        prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
        exact_hits INTEGER NOT NULL DEFAULT 0, semantic_hits INTEGER NOT NULL DEFAULT 0,
        tokens_saved INTEGER NOT NULL DEFAULT 0, cost_usd REAL NOT NULL DEFAULT 0,
        saved_usd REAL NOT NULL DEFAULT 0, PRIMARY KEY (day, tenant, model, route))
        WITHOUT ROWID;
        INSERT INTO usage VALUES ('2026-12-01', 'acme', 'llama', 'chat', 1, 5, 2, 0, 0, 0, 0.1, 0);
        """
    )
    old.close()
    ledger = BufferedLedger(SqliteStorage(path), clock=time.time)
    await ledger.start()
    try:
        ledger.add(record("acme", "llama", "chat", "2026-12-01", prefix_cached_tokens=3))
        await ledger.flush()
        (row,) = await ledger.query("2026-12-01", "2026-12-01", ["tenant"], None)
        assert (row["requests"], row["prompt_tokens"], row["prefix_cached_tokens"]) == (2, 5, 3)
    finally:
        await ledger.aclose()
