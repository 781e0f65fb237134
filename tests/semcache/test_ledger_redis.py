"""The usage ledger on a real Redis: gateways sum into one ledger, outages lose nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis

from semcache.ledger import (
    BufferedLedger,
    LedgerSettings,
    UsageLedger,
    UsageRecord,
    open_ledger,
)
from semcache.ledger.base import Batch
from semcache.ledger.records import Counts
from semcache.ledger.redis import RedisStorage
from tests.semcache.conftest import RedisServer
from tests.semcache.test_ledger import at, record
from tests.support.stepped_clock import SteppedClock

pytestmark = pytest.mark.slow

DAY = "2026-12-02"


def redis_ledger(url: str, prefix: str, tmp_path: Path, clock: Callable[[], float]) -> UsageLedger:
    return open_ledger(
        LedgerSettings(flush_interval_s=3600.0),  # the tests flush by hand
        data_dir=tmp_path,
        redis_url=url,
        redis_prefix=prefix,
        clock=clock,
    )


def usage(i: int, tenant: str = "acme") -> UsageRecord:
    return record(
        tenant,
        "llama" if i % 3 else "minilm",
        "chat" if i % 2 else "embeddings",
        DAY,
        prompt_tokens=i,
        completion_tokens=2 * i,
        exact_hits=int(i % 5 == 0),
        tokens_saved=3 * i if i % 5 == 0 else 0,
        cost_usd=0.0 if i % 5 == 0 else i * 1e-6,
        saved_usd=i * 1e-6 if i % 5 == 0 else 0.0,
    )


def expected(records: list[UsageRecord]) -> dict[str, float]:
    fields = ("requests", "prompt_tokens", "completion_tokens", "exact_hits", "tokens_saved")
    out: dict[str, float] = {f: sum(getattr(r, f) for r in records) for f in fields}
    out["cost_usd"] = sum(r.cost_usd for r in records)
    out["saved_usd"] = sum(r.saved_usd for r in records)
    return out


def assert_totals(row: dict[str, object], records: list[UsageRecord]) -> None:
    for field, value in expected(records).items():
        if field.endswith("_usd"):
            assert row[field] == pytest.approx(value, rel=1e-9), field
        else:
            assert row[field] == value, field


async def test_two_gateways_on_one_redis_sum_into_one_ledger(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    clock = SteppedClock(at(DAY))
    a = redis_ledger(redis_server.url, redis_prefix, tmp_path / "a", clock)
    b = redis_ledger(redis_server.url, redis_prefix, tmp_path / "b", clock)
    await a.start()
    await b.start()
    try:
        sent_a = [usage(i) for i in range(1, 101)]
        sent_b = [usage(i, tenant="acme" if i % 2 else "beta") for i in range(101, 181)]
        for r in sent_a:
            a.add(r)
        await a.flush()
        for r in sent_b[:40]:
            b.add(r)
        await b.flush()
        for r in sent_b[40:]:
            b.add(r)  # written by b's next flush; a does not see them until then
        (row,) = await a.query(DAY, DAY, [], None)
        assert_totals(row, sent_a + sent_b[:40])
        (row,) = await b.query(DAY, DAY, [], None)
        assert_totals(row, sent_a + sent_b)
        await b.flush()
        everything = sent_a + sent_b
        for ledger in (a, b):
            (row,) = await ledger.query(DAY, DAY, [], None)
            assert_totals(row, everything)
            by_tenant = await ledger.query(DAY, DAY, ["tenant"], None)
            assert [t["tenant"] for t in by_tenant] == ["acme", "beta"]
            for t in by_tenant:
                assert_totals(t, [x for x in everything if x.tenant == t["tenant"]])
            mine = await ledger.query(DAY, DAY, ["model", "route"], "beta")
            assert len(mine) == 2  # beta: even i, embeddings only
            for m in mine:
                assert_totals(
                    m,
                    [
                        x
                        for x in everything
                        if (x.tenant, x.model, x.route) == ("beta", m["model"], m["route"])
                    ],
                )
        beta = [x for x in everything if x.tenant == "beta"]
        tokens = sum(x.prompt_tokens + x.completion_tokens for x in beta)
        spend = await a.spent("beta", "month", at(DAY))
        assert spend.tokens == tokens
        assert spend.usd == pytest.approx(sum(x.cost_usd for x in beta), rel=1e-9)
        assert spend.tokens_saved == sum(x.tokens_saved for x in beta)
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_batch_sent_twice_is_applied_once(shared_redis_url: str, redis_prefix: str) -> None:
    """A flush whose answer was lost (Redis applied it, the client timed out) is retried as
    the same batch; Redis must not count it twice."""
    storage = RedisStorage(shared_redis_url, prefix=redis_prefix)
    counts = Counts()
    counts.add(usage(7).key, usage(7).values())
    batch = Batch(counts)
    try:
        await storage.write([batch])
        assert batch.attempted
        await storage.write([batch])  # the retry
        ((_, values),) = await storage.read(DAY, DAY, [], None)
        assert values[0] == 1 and values[1] == 7
        assert await storage.read_spend("acme", DAY) == (21, pytest.approx(7e-6), 0)
    finally:
        await storage.close()


async def test_redis_down_at_flush_then_back_totals_exact(
    redis_factory: Callable[[], RedisServer],
    redis_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory()
    clock = SteppedClock(at(DAY))
    ledger = redis_ledger(server.url, redis_prefix, tmp_path, clock)
    await ledger.start()
    assert isinstance(ledger, BufferedLedger)
    sent = [usage(i) for i in range(1, 61)]
    try:
        for r in sent[:20]:
            ledger.add(r)
        await ledger.flush()
        server.stop()  # (no persistence: what was written is gone with it)
        sent = sent[20:]
        caplog.set_level(logging.WARNING, logger="semcache.ledger.base")
        for r in sent[:20]:
            ledger.add(r)
        await ledger.flush()
        for r in sent[20:]:
            ledger.add(r)
        await ledger.flush()
        assert ledger.failed_flushes == 2
        warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(warnings) == 1  # logged once per outage
        # Budgets still count what is kept in memory.
        spend = await ledger.spent("acme", "day", at(DAY))
        assert spend.tokens == sum(r.prompt_tokens + r.completion_tokens for r in sent)

        server.start()  # back, empty
        await ledger.flush()
        assert any("takes writes again" in r.getMessage() for r in caplog.records)
        (row,) = await ledger.query(DAY, DAY, [], None)
        assert_totals(row, sent)
        await ledger.flush()  # nothing left to write: nothing is written twice
        (row,) = await ledger.query(DAY, DAY, [], None)
        assert_totals(row, sent)
    finally:
        await ledger.aclose()


class ReplyEater:
    """A TCP proxy in front of Redis that, while ``eating``, forwards every command but drops
    Redis's integer answers (what the ledger's script returns; a PING's or the connection
    set-up's answers pass): the script runs and the client times out, as when a reply is
    lost in the network."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.eating = False
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task[object]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        task.add_done_callback(self.connections.discard)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, replies: bool) -> None:
            with contextlib.suppress(OSError):
                while chunk := await src.read(65536):
                    if replies and self.eating and chunk.startswith(b":"):
                        continue
                    dst.write(chunk)
                    await dst.drain()
            dst.close()

        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    async def aclose(self) -> None:
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_a_flush_whose_answer_is_lost_is_not_counted_twice(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Redis applies a flush but its answer never arrives (the client times out): the retry
    sends the same batch, which Redis recognizes and does not count again."""
    proxy = ReplyEater(redis_server.port)
    clock = SteppedClock(at(DAY))
    ledger = redis_ledger(await proxy.start(), redis_prefix, tmp_path, clock)
    assert isinstance(ledger, BufferedLedger)
    await ledger.start()
    admin = Redis.from_url(redis_server.url)
    sent = [usage(i) for i in range(1, 31)]
    try:
        for r in sent:
            ledger.add(r)
        proxy.eating = True
        await ledger.flush()
        assert ledger.failed_flushes == 1
        assert await admin.keys(f"{{{redis_prefix}:usage}}:batch:*")  # applied all the same
        proxy.eating = False
        more = [usage(i) for i in range(31, 41)]
        for r in more:
            ledger.add(r)
        await ledger.flush()
        assert ledger.failed_flushes == 1
        (row,) = await ledger.query(DAY, DAY, [], None)
        assert_totals(row, sent + more)
        spend = await ledger.spent("acme", "day", at(DAY))
        assert spend.tokens == sum(r.prompt_tokens + r.completion_tokens for r in sent + more)
        assert spend.usd == pytest.approx(sum(r.cost_usd for r in sent + more), rel=1e-9)
        assert len(await admin.keys(f"{{{redis_prefix}:usage}}:batch:*")) == 2
    finally:
        await admin.aclose()
        await ledger.aclose()
        await proxy.aclose()


async def test_a_flush_no_replica_confirmed_is_kept_sent_again_and_counted_once(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, tmp_path: Path
) -> None:
    """``replicas = 1``: with no replica the flush is applied on the primary but not
    confirmed, so it is kept; once a replica follows, the next flush sends it again, it is
    confirmed, and the primary (and the replica) count it once."""
    primary, replica = redis_factory(), redis_factory()
    clock = SteppedClock(at(DAY))
    ledger = open_ledger(
        LedgerSettings(flush_interval_s=3600.0, replicas=1, replica_timeout_s=0.2),
        data_dir=tmp_path,
        redis_url=primary.url,
        redis_prefix=redis_prefix,
        clock=clock,
    )
    await ledger.start()
    follower = Redis.from_url(replica.url)
    try:
        sent = [usage(i) for i in range(1, 21)]
        for r in sent:
            ledger.add(r)
        await ledger.flush()
        assert isinstance(ledger, BufferedLedger)
        assert ledger.failed_flushes == 1  # applied on the primary, not confirmed: kept
        await follower.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        for _ in range(100):  # the replica's first sync
            info = await follower.info("replication")
            if info.get("master_link_status") == "up":
                break
            await asyncio.sleep(0.1)
        await ledger.flush()
        assert ledger.failed_flushes == 1
        (row,) = await ledger.query(DAY, DAY, [], None)
        assert_totals(row, sent)  # sent twice, counted once
        copy = redis_ledger(replica.url, redis_prefix, tmp_path / "replica", clock)
        try:
            (row,) = await copy.query(DAY, DAY, [], None)
            assert_totals(row, sent)
        finally:
            await copy.aclose()
    finally:
        await follower.aclose()
        await ledger.aclose()
