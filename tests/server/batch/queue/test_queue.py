"""The batch queue contract, on SQLite (local disk) and on a real redis-server (Streams)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest
from redis.asyncio.cluster import RedisCluster

from server.batch.queue.base import BatchQueue, WorkItem
from server.batch.queue.disk import DiskQueue
from server.batch.queue.redis import RedisQueue
from tests.support.stepped_clock import SteppedClock
from tests.support.waiting import wait_until_async

QueueFactory = Callable[..., Awaitable[BatchQueue]]

LEASE_S = 0.4


@pytest.fixture
def clock() -> SteppedClock:
    """The disk queue's clock. Redis Streams measure a lease (XAUTOCLAIM's min-idle-time) and
    a result's TTL (PEXPIRE) on the redis-server's own clock, which no fake moves: there the
    tests wait, in a bounded poll, for what they expect."""
    return SteppedClock(time.time())


@pytest.fixture(
    params=[
        "disk",
        pytest.param("redis", marks=pytest.mark.slow),
        pytest.param("redis-cluster", marks=pytest.mark.slow),
    ]
)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make_queue(
    request: pytest.FixtureRequest, kind: str, clock: SteppedClock, tmp_path: Path
) -> AsyncIterator[QueueFactory]:
    """Opens queues of one kind; queues opened by one test share their storage."""
    opened: list[BatchQueue] = []
    prefix = f"t{uuid.uuid4().hex[:10]}"

    async def make(**kwargs: Any) -> BatchQueue:
        kwargs.setdefault("lease_s", LEASE_S)
        queue: BatchQueue
        if kind == "disk":
            queue = await DiskQueue.open(tmp_path / "q.sqlite3", poll_s=0.02, clock=clock, **kwargs)
        else:
            fixture = "redis_cluster" if kind == "redis-cluster" else "redis_server"
            url: str = request.getfixturevalue(fixture).url
            queue = await RedisQueue.open(url, prefix=prefix, **kwargs)
        opened.append(queue)
        return queue

    try:
        yield make
    finally:
        for q in opened:
            await q.aclose()


def payloads(n: int) -> list[bytes]:
    return [f"item-{i}".encode() for i in range(n)]


async def drain(queue: BatchQueue, consumer: str, limit: int = 10) -> list[WorkItem]:
    out: list[WorkItem] = []
    while batch := await queue.claim(consumer, limit, wait_s=0.05):
        out.extend(batch)
    return out


async def claim_after_lease(
    q: BatchQueue, kind: str, clock: SteppedClock, consumer: str, n: int
) -> list[WorkItem]:
    """The ``n`` items whose lease ran out, claimed by ``consumer``: on disk the clock moves
    past the lease; on Redis the claims go on (bounded) until the server hands them over."""
    if kind == "disk":
        clock.advance(LEASE_S + 0.1)
        return await q.claim(consumer, n, wait_s=0.0)
    taken: list[WorkItem] = []

    async def all_taken() -> bool:
        taken.extend(await q.claim(consumer, n - len(taken), wait_s=0.05))
        return len(taken) >= n

    await wait_until_async(all_taken, timeout_s=10 * LEASE_S + 5)
    return taken


def count_looks(q: BatchQueue) -> list[int]:
    """Counts the disk queue's looks for claimable work (``[n]``, updated as they happen)."""
    assert isinstance(q, DiskQueue)
    looks = [0]
    look = q._claim_or_due

    def counted(consumer: str, limit: int) -> tuple[list[WorkItem], float | None]:
        looks[0] += 1
        return look(consumer, limit)

    q._claim_or_due = counted  # type: ignore[method-assign]
    return looks


async def redis_claim_blocks(q: BatchQueue) -> bool:
    """True once a claim of ``q`` waits for new work: its connection is blocked in XREADGROUP."""
    assert isinstance(q, RedisQueue)
    clients: list[dict[str, Any]]
    if isinstance(q.client, RedisCluster):
        # CLIENT LIST goes to the cluster's default node, not the one holding the stream: ask all
        per_node = cast(
            dict[str, list[dict[str, Any]]],
            await q.client.client_list(target_nodes=RedisCluster.ALL_NODES),
        )
        clients = [c for listed in per_node.values() for c in listed]
    else:
        clients = await q.client.client_list()
    return any(c.get("cmd") == "xreadgroup" and "b" in str(c.get("flags")) for c in clients)


async def test_life_cycle_queued_running_done(make_queue: QueueFactory) -> None:
    q = await make_queue()
    await q.submit("job1", "acme", "@cf/test/tiny", payloads(3))
    state = await q.job("job1")
    assert state is not None and state.status == "queued"
    assert (state.tenant, state.model, state.total, state.completed) == (
        "acme",
        "@cf/test/tiny",
        3,
        0,
    )

    items = await q.claim("w1", 2, wait_s=0.1)
    assert [(i.job_id, i.index, i.payload, i.attempts) for i in items] == [
        ("job1", 0, b"item-0", 1),
        ("job1", 1, b"item-1", 1),
    ]
    state = await q.job("job1")
    assert state is not None and state.status == "running"

    assert await q.complete(items[1], b"r1")
    assert await q.complete(items[0], b"r0")
    (last,) = await q.claim("w1", 5, wait_s=0.1)
    assert last.index == 2
    assert await q.complete(last, b"r2")
    state = await q.job("job1")
    assert state is not None and state.status == "done" and state.finished_at is not None
    assert [(r.index, r.body) for r in await q.results("job1")] == [
        (0, b"r0"),
        (1, b"r1"),
        (2, b"r2"),
    ]
    assert await q.claim("w1", 5, wait_s=0.05) == []


async def test_depth_counts_unfinished_items(make_queue: QueueFactory, clock: SteppedClock) -> None:
    q = await make_queue()
    empty = await q.depth()
    assert (empty.items, empty.leased, empty.oldest_age_s) == (0, 0, None)
    await q.submit("job1", "acme", "@cf/test/tiny", payloads(3))
    clock.advance(2.0)
    (item,) = await q.claim("w1", 1, wait_s=0.1)
    depth = await q.depth()
    assert (depth.items, depth.leased) == (3, 1)
    assert depth.oldest_age_s is not None and depth.oldest_age_s >= 0.0
    assert await q.complete(item, b"r0")
    assert (await q.depth()).items == 2


async def test_unknown_job_is_none(make_queue: QueueFactory) -> None:
    q = await make_queue()
    assert await q.job("nope") is None
    assert await q.results("nope") == []


async def test_a_second_result_for_an_item_is_ignored(make_queue: QueueFactory) -> None:
    q = await make_queue()
    await q.submit("j", "t", "m", payloads(1))
    (item,) = await q.claim("w1", 1, wait_s=0.1)
    assert await q.complete(item, b"first")
    assert not await q.complete(item, b"second")
    assert [r.body for r in await q.results("j")] == [b"first"]
    state = await q.job("j")
    assert state is not None and state.completed == 1


async def test_consumers_never_share_a_live_claim(make_queue: QueueFactory) -> None:
    q = await make_queue()
    await q.submit("j", "t", "m", payloads(40))
    a, b = await asyncio.gather(drain(q, "a", 3), drain(q, "b", 3))
    got = sorted(i.index for i in a + b)
    assert got == list(range(40))
    assert a and b


async def test_expired_lease_goes_to_another_worker_with_one_result(
    make_queue: QueueFactory, kind: str, clock: SteppedClock
) -> None:
    q = await make_queue()
    await q.submit("j", "t", "m", payloads(2))
    dead = await q.claim("dead", 2, wait_s=0.1)  # then the worker is "killed": no extend
    assert len(dead) == 2
    assert await q.claim("alive", 2, wait_s=0.0) == []
    taken = await claim_after_lease(q, kind, clock, "alive", 2)
    assert sorted(i.index for i in taken) == [0, 1]
    assert all(i.attempts == 2 for i in taken)
    for item in taken:
        assert await q.complete(item, b"alive")
    # The dead worker comes back and answers too late: its results are dropped.
    for item in dead:
        assert not await q.complete(item, b"dead")
    assert [r.body for r in await q.results("j")] == [b"alive", b"alive"]


async def test_extended_lease_is_kept(
    make_queue: QueueFactory, kind: str, clock: SteppedClock
) -> None:
    q = await make_queue()
    await q.submit("j", "t", "m", payloads(1))
    items = await q.claim("w1", 1, wait_s=0.1)
    for _ in range(4):
        if kind == "disk":
            clock.advance(LEASE_S / 2)
        else:  # the lease runs on the redis-server's clock: only real time moves it
            await asyncio.sleep(LEASE_S / 2)
        await q.extend("w1", items)
    assert await q.claim("w2", 1, wait_s=0.0) == []
    assert await q.complete(items[0], b"ok")


async def test_retry_gives_the_item_back(make_queue: QueueFactory) -> None:
    q = await make_queue()
    await q.submit("j", "t", "m", payloads(1))
    (item,) = await q.claim("w1", 1, wait_s=0.1)
    await q.retry(item, 0.0)
    (again,) = await q.claim("w2", 1, wait_s=0.5)
    assert (again.index, again.payload, again.attempts) == (0, b"item-0", 2)
    assert await q.complete(again, b"ok")


async def test_a_delayed_retry_waits_its_delay_and_not_just_the_lease(
    make_queue: QueueFactory, kind: str, clock: SteppedClock
) -> None:
    """``retry(item, delay)`` holds the item back for ``delay`` (longer than the lease here),
    counts it as waiting meanwhile, and then any worker's claim gets it."""
    delay = 3 * LEASE_S
    q = await make_queue()
    await q.submit("j", "t", "m", payloads(1))
    (item,) = await q.claim("w1", 1, wait_s=0.1)
    await q.retry(item, delay)
    assert await q.claim("w2", 1, wait_s=0.0) == []
    depth = await q.depth()
    assert (depth.items, depth.leased) == (1, 0)
    if kind == "disk":
        clock.advance(delay / 2)
        assert await q.claim("w2", 1, wait_s=0.0) == []
        clock.advance(delay / 2 + 0.01)
        (again,) = await q.claim("w2", 1, wait_s=0.0)
    else:  # due on the gateway's clock: a waiting claim wakes when the item is due
        loop = asyncio.get_running_loop()
        start = loop.time()
        (again,) = await asyncio.wait_for(q.claim("w2", 1, wait_s=10.0), 10.0)
        waited = loop.time() - start
        assert delay * 0.8 <= waited < delay + 3.0
    assert (again.index, again.payload, again.attempts) == (0, b"item-0", 2)
    assert await q.complete(again, b"ok")
    state = await q.job("j")
    assert state is not None and state.status == "done"
    assert (await q.depth()).items == 0


@pytest.mark.slow
async def test_a_redis_claim_waits_longer_than_redis_pys_default_socket_timeout(
    redis_server: Any,
) -> None:
    """redis-py 8 gives up on any read after 5 s: a claim told to wait 6 s blocks in shorter
    reads and returns empty, without an error."""
    q = await RedisQueue.open(redis_server.url, prefix=f"t{uuid.uuid4().hex[:10]}", lease_s=30)
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await q.claim("w1", 1, wait_s=6.0) == []
        assert loop.time() - start >= 5.9
    finally:
        await q.aclose()


async def test_waiting_claim_wakes_up_for_new_work(make_queue: QueueFactory, kind: str) -> None:
    q = await make_queue()
    looks = count_looks(q) if kind == "disk" else None
    waiter = asyncio.create_task(q.claim("w1", 1, wait_s=5.0))
    if looks is not None:
        await wait_until_async(lambda: looks[0] >= 1, timeout_s=5.0)  # looked, found none
    else:
        await wait_until_async(lambda: redis_claim_blocks(q), timeout_s=5.0)
    await q.submit("j", "t", "m", payloads(1))
    (item,) = await asyncio.wait_for(waiter, 5.0)
    assert item.job_id == "j"


async def test_finished_jobs_expire(
    make_queue: QueueFactory, kind: str, clock: SteppedClock
) -> None:
    q = await make_queue(results_ttl_s=0.3)
    await q.submit("j", "t", "m", payloads(1))
    (item,) = await q.claim("w1", 1, wait_s=0.1)
    await q.complete(item, b"ok")
    assert await q.job("j") is not None
    if kind == "disk":
        clock.advance(0.31)
        await q.purge_expired()
    else:  # PEXPIRE runs on the redis-server's clock: wait (bounded) for the key to go

        async def gone() -> bool:
            await q.purge_expired()
            return await q.job("j") is None

        await wait_until_async(gone, timeout_s=5.0)
    assert await q.job("j") is None
    assert await q.results("j") == []


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_jobs_trace_context_comes_back_with_each_claim(
    make_queue: QueueFactory, kind: str, clock: SteppedClock
) -> None:
    q = await make_queue()
    await q.submit("traced", "t", "m", payloads(2), trace_context=TRACEPARENT)
    await q.submit("plain", "t", "m", payloads(1))
    items = await drain(q, "w1")
    assert {(i.job_id, i.index): i.trace_context for i in items} == {
        ("traced", 0): TRACEPARENT,
        ("traced", 1): TRACEPARENT,
        ("plain", 0): None,
    }
    first = next(i for i in items if i.job_id == "traced")
    await q.retry(first, 0.0)  # given back and claimed again: still linked
    again = await claim_after_lease(q, kind, clock, "w2", 1)
    assert [(i.job_id, i.trace_context) for i in again] == [("traced", TRACEPARENT)]


OLD_DISK_SCHEMA = """
CREATE TABLE jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, model TEXT NOT NULL, total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0, started INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL, finished_at REAL
);
CREATE TABLE items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, idx INTEGER NOT NULL,
    payload BLOB NOT NULL, leased_by TEXT, lease_until REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0, UNIQUE (job_id, idx)
);
CREATE TABLE results (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, body BLOB NOT NULL, PRIMARY KEY (job_id, idx)
) WITHOUT ROWID;
"""
"""The queue file as gateways wrote it before jobs kept the submitter's trace context."""


async def test_a_disk_queue_written_before_trace_contexts_loads(
    tmp_path: Path, clock: SteppedClock
) -> None:
    path = tmp_path / "q.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(OLD_DISK_SCHEMA)
        db.execute(
            "INSERT INTO jobs (id, tenant, model, total, created_at) VALUES (?, ?, ?, ?, ?)",
            ("old", "t", "m", 1, clock()),
        )
        db.execute("INSERT INTO items (job_id, idx, payload) VALUES ('old', 0, x'6f6c64')")
        db.commit()
    q = await DiskQueue.open(path, lease_s=LEASE_S, clock=clock)
    try:
        await q.submit("new", "t", "m", payloads(1), trace_context=TRACEPARENT)
        items = await drain(q, "w1")
        assert [(i.job_id, i.payload, i.trace_context) for i in items] == [
            ("old", b"old", None),
            ("new", b"item-0", TRACEPARENT),
        ]
        assert await q.complete(items[0], b"r")
        state = await q.job("old")
        assert state is not None and state.status == "done"
    finally:
        await q.aclose()
    reopened = await DiskQueue.open(path, lease_s=LEASE_S, clock=clock)  # the column once
    await reopened.aclose()


async def test_disk_queue_survives_reopen(tmp_path: Path, clock: SteppedClock) -> None:
    path = tmp_path / "q.sqlite3"
    first = await DiskQueue.open(path, lease_s=LEASE_S, clock=clock)
    await first.submit("j", "t", "m", payloads(3))
    (item,) = await first.claim("w1", 1, wait_s=0.1)
    await first.complete(item, b"r0")
    await first.claim("w1", 1, wait_s=0.1)  # claimed, never finished: the process "dies"
    await first.aclose()

    second = await DiskQueue.open(path, lease_s=LEASE_S, clock=clock)
    try:
        clock.advance(LEASE_S + 0.1)
        rest = await drain(second, "w2")
        assert sorted(i.index for i in rest) == [1, 2]
        for i in rest:
            assert await second.complete(i, b"r")
        state = await second.job("j")
        assert state is not None and state.status == "done"
        assert [r.index for r in await second.results("j")] == [0, 1, 2]
    finally:
        await second.aclose()


async def test_disk_purge_removes_everything_of_an_expired_job(tmp_path: Path) -> None:
    now = [1000.0]
    q = await DiskQueue.open(tmp_path / "q.sqlite3", results_ttl_s=10, clock=lambda: now[0])
    try:
        await q.submit("done", "t", "m", payloads(1))
        await q.submit("open", "t", "m", payloads(1))
        (item,) = await q.claim("w", 1, wait_s=0)
        assert item.job_id == "done"
        await q.complete(item, b"x")
        now[0] += 11
        assert await q.purge_expired() == 1
        assert await q.job("done") is None
        assert await q.job("open") is not None
    finally:
        await q.aclose()


async def test_idle_disk_claim_sleeps_until_a_submit_or_a_due_retry(tmp_path: Path) -> None:
    """No polling while idle: one look, then asleep until this process submits or gives an
    item back, or a retry delay runs out (``poll_s`` is only for other processes)."""
    q = await DiskQueue.open(tmp_path / "q.sqlite3", poll_s=60.0, lease_s=LEASE_S)
    looks = 0
    look = q._claim_or_due

    def counted(consumer: str, limit: int) -> tuple[list[WorkItem], float | None]:
        nonlocal looks
        looks += 1
        return look(consumer, limit)

    q._claim_or_due = counted  # type: ignore[method-assign]
    try:
        waiter = asyncio.create_task(q.claim("w1", 1, wait_s=30.0))
        # Real time on purpose: that an idle claim does not look again is what is checked.
        await asyncio.sleep(1.0)
        assert looks == 1 and not waiter.done()
        await q.submit("j", "t", "m", payloads(1))
        (item,) = await asyncio.wait_for(waiter, 2.0)
        await q.retry(item, 0.5)
        start = asyncio.get_running_loop().time()
        (again,) = await asyncio.wait_for(q.claim("w1", 1, wait_s=30.0), 5.0)
        waited = asyncio.get_running_loop().time() - start
        assert 0.4 <= waited < 2.0 and again.index == 0
        assert looks <= 5
    finally:
        await q.aclose()
