"""The memory and disk tiers, and the Redis circuit breaker (Redis itself: test_redis.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from semcache.tiers import CircuitBreaker, DiskStore, MemoryStore
from tests.support.stepped_clock import SteppedClock

# --------------------------------------------------------------------------- memory


async def test_memory_get_set_delete_and_ttl() -> None:
    clock = SteppedClock(1000.0)
    store = MemoryStore[bytes](10_000, clock=clock)
    await store.set("a", b"1", ttl_s=5)
    await store.set("b", b"2")
    assert await store.get("a") == b"1"
    clock.now += 5
    assert await store.get("a") is None  # expired
    assert await store.get("b") == b"2"  # no TTL
    await store.delete("b")
    await store.delete("never-there")
    assert await store.get("b") is None
    assert len(store) == 0 and store.bytes_used == 0


async def test_memory_byte_bound_evicts_least_recently_used() -> None:
    store = MemoryStore[bytes](2_000)
    for i in range(10):
        await store.set(f"k{i}", bytes(300))
        assert store.bytes_used <= store.max_bytes
    present = [i for i in range(10) if await store.get(f"k{i}") is not None]
    assert present == list(range(10 - len(present), 10))  # the newest survive
    assert store.evictions == 10 - len(present)
    # A read makes an entry recent: it survives the next eviction.
    oldest = present[0]
    await store.get(f"k{oldest}")
    await store.set("new", bytes(300))
    assert await store.get(f"k{oldest}") is not None
    assert await store.get(f"k{present[1]}") is None


async def test_memory_refuses_values_larger_than_the_bound() -> None:
    store = MemoryStore[bytes](1_000)
    await store.set("small", bytes(10))
    await store.set("huge", bytes(5_000))
    assert await store.get("huge") is None
    assert await store.get("small") is not None


async def test_memory_overwrite_accounts_bytes_once() -> None:
    store = MemoryStore[bytes](100_000)
    await store.set("k", bytes(1000))
    used = store.bytes_used
    await store.set("k", bytes(1000))
    assert store.bytes_used == used
    await store.set("k", bytes(10))
    assert store.bytes_used < used


async def test_memory_namespaces_and_clear() -> None:
    root = MemoryStore[bytes](100_000)
    a = root.with_namespace("a")
    ab = a.with_namespace("b")
    other = root.with_namespace("other")
    await a.set("k", b"a")
    await ab.set("k", b"ab")
    await other.set("k", b"o")
    assert await a.get("k") == b"a" and await ab.get("k") == b"ab"
    await a.clear()  # clears a and its child namespace
    assert await a.get("k") is None and await ab.get("k") is None
    assert await other.get("k") == b"o"
    await root.clear()
    assert await other.get("k") is None and root.bytes_used == 0


# --------------------------------------------------------------------------- disk


async def test_disk_get_set_delete(tmp_path: Path) -> None:
    async with DiskStore(tmp_path / "l2", max_bytes=10_000_000) as store:
        await store.set("a", b"payload")
        assert await store.get("a") == b"payload"
        await store.delete_many(["a", "missing"])
        assert await store.get("a") is None


async def test_disk_is_shared_by_two_handles_on_one_directory(tmp_path: Path) -> None:
    """Two workers of one machine open the same directory."""
    async with DiskStore(tmp_path / "l2") as one, DiskStore(tmp_path / "l2") as two:
        await one.set("k", b"from worker one")
        assert await two.get("k") == b"from worker one"


async def test_disk_ttl(tmp_path: Path) -> None:
    async with DiskStore(tmp_path / "l2") as store:
        # diskcache expires entries on its own clock: a 1 µs TTL has run out by the next read.
        await store.set("short", b"x", ttl_s=1e-6)
        await store.set("long", b"y", ttl_s=60)
        assert await store.get("short") is None
        assert await store.get("long") == b"y"


async def test_disk_fill_up_stays_within_its_size_limit(tmp_path: Path) -> None:
    limit = 256 * 1024
    async with DiskStore(tmp_path / "l2", max_bytes=limit) as store:
        for i in range(200):  # 200 x 8 KiB = 1.6 MiB written into a 256 KiB cache
            await store.set(f"k{i}", os.urandom(8192))
        # diskcache culls at most cull_limit items per write, so allow a little slack.
        assert store.volume <= limit * 1.5
        assert await store.get("k199") is not None
        survivors = [i for i in range(200) if await store.get(f"k{i}") is not None]
        assert 0 < len(survivors) < 200


async def test_disk_namespaces_and_clear(tmp_path: Path) -> None:
    async with DiskStore(tmp_path / "l2") as root:
        a = root.with_namespace("a")
        b = root.with_namespace("b")
        await a.set("k", b"a")
        await a.with_namespace("c").set("k", b"ac")
        await b.set("k", b"b")
        await a.clear()
        assert await a.get("k") is None
        assert await a.with_namespace("c").get("k") is None
        assert await b.get("k") == b"b"
        await root.clear()
        assert await b.get("k") is None


# --------------------------------------------------------------------------- breaker


def test_circuit_breaker_backs_off_probes_once_and_recovers() -> None:
    now = [0.0]
    breaker = CircuitBreaker("test", retry_after_s=1.0, max_retry_after_s=4.0, clock=lambda: now[0])
    assert breaker.allow()
    breaker.failure(ConnectionError("refused"))
    assert not breaker.allow()  # backing off
    now[0] = 1.0
    assert breaker.allow()  # one probe...
    assert not breaker.allow()  # ...at a time
    breaker.failure(ConnectionError("refused"))
    now[0] = 2.5
    assert not breaker.allow()  # the back-off doubled to 2 s
    now[0] = 3.0
    assert breaker.allow()
    breaker.abandon()  # the probe was cancelled: another may try
    assert breaker.allow()
    breaker.success()
    assert not breaker.is_open and breaker.allow() and breaker.allow()
    assert breaker.failures == 1


# --------------------------------------------------------------------------- disk key filter


def _sqlite_reads(store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    real = store._get

    def counting(key: str) -> bytes | None:
        reads.append(key)
        return real(key)

    monkeypatch.setattr(store, "_get", counting)
    return reads


async def test_disk_miss_skips_sqlite_once_the_key_filter_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with DiskStore(tmp_path / "l2") as store:
        await store.set("present", b"v")
        assert store.key_filter is not None
        await store.key_filter.wait_ready()
        reads = _sqlite_reads(store, monkeypatch)
        for i in range(20):
            assert await store.get(f"absent-{i}") is None
        assert reads == [] and store.key_filter.skipped == 20
        assert await store.get("present") == b"v"
        assert reads == ["present"]


async def test_disk_key_filter_sees_keys_written_before_a_restart(tmp_path: Path) -> None:
    async with DiskStore(tmp_path / "l2") as first:
        await first.set("old", b"kept")
    async with DiskStore(tmp_path / "l2") as second:
        assert second.key_filter is not None
        await second.key_filter.wait_ready()
        assert len(second.key_filter) == 1
        assert await second.get("old") == b"kept"


async def test_disk_key_filter_never_hides_another_workers_write(tmp_path: Path) -> None:
    """Two worker processes share a directory: each one's filter must notice the other."""
    async with DiskStore(tmp_path / "l2") as one, DiskStore(tmp_path / "l2") as two:
        assert one.key_filter is not None and two.key_filter is not None
        await one.key_filter.wait_ready()
        await two.key_filter.wait_ready()
        assert await two.get("k") is None  # exact filter: absent
        for i in range(5):
            await one.set(f"k{i}", f"from one {i}".encode())
            # Read at once, before two's filter has caught up: the generation moved, so two
            # asks SQLite instead of trusting its set.
            assert await two.get(f"k{i}") == f"from one {i}".encode()
        await two.key_filter.wait_ready()
        assert await two.get("k4") == b"from one 4"
        skipped = two.key_filter.skipped
        assert await two.get("never") is None
        assert two.key_filter.skipped == skipped + 1  # trusted again after catching up


async def test_disk_writes_are_group_committed_and_readable_while_pending(
    tmp_path: Path,
) -> None:
    async with DiskStore(tmp_path / "l2") as store:
        writes = [store.set(f"k{i}", f"v{i}".encode()) for i in range(50)]
        tasks = [asyncio.create_task(w) for w in writes]
        await asyncio.sleep(0)
        assert await store.get("k49") == b"v49"  # pending or in flight, already readable
        await asyncio.gather(*tasks)
        assert store._backend.batches < 50
        assert [await store.get(f"k{i}") for i in range(50)] == [
            f"v{i}".encode() for i in range(50)
        ]
    async with DiskStore(tmp_path / "l2") as again:
        assert await again.get("k0") == b"v0"


async def test_disk_delete_of_a_pending_write_is_not_undone_by_the_batch(
    tmp_path: Path,
) -> None:
    async with DiskStore(tmp_path / "l2") as store:
        first = asyncio.create_task(store.set("a", b"1"))
        await asyncio.sleep(0)
        pending = asyncio.create_task(store.set("b", b"2"))  # waits for the next batch
        await asyncio.sleep(0)
        await store.delete("b")
        await asyncio.gather(first, pending)
        assert await store.get("b") is None
        assert await store.get("a") == b"1"


async def test_disk_writes_behind_are_batched_within_the_linger_time(tmp_path: Path) -> None:
    async with (
        DiskStore(tmp_path / "l2", linger_s=30.0) as store,
        DiskStore(tmp_path / "l2") as other,
    ):
        for i in range(20):
            store.set_behind(f"k{i}", f"v{i}".encode(), ttl_s=60)
        assert await store.get("k7") == b"v7"  # this process reads its pending writes
        assert await other.get("k7") is None  # not committed yet (30 s linger)
        await store.flush()
        assert store._backend.batches == 1
        assert await other.get("k7") == b"v7"
