"""The batch record stores (local disk, Redis): tenant scoping, listing pages, the sweep's
unfinished batches, the dashboard's recent ones, and the retention of finished records."""

from __future__ import annotations

from typing import Any

from server.openai.batches.protocol import BatchObject
from server.openai.records import tenant_key
from tests.server.openai.conftest import StoresFactory


def batch(n: int, *, tenant: str = "t", status: Any = "in_progress", at: float = 0) -> BatchObject:
    return BatchObject(
        id=f"batch_{n:04d}",
        tenant=tenant,
        endpoint="/v1/chat/completions",
        input_file_id="file-in",
        completion_window="24h",
        status=status,
        created_at=int(at) + n,
        expires_at=int(at) + n + 86400,
    )


async def test_records_are_scoped_listed_in_pages_and_swept(make_stores: StoresFactory) -> None:
    stores = make_stores()
    one, now = stores.batches, stores.clock.now
    for n in range(5):
        await one.save(batch(n, status="completed" if n % 2 else "in_progress", at=now))
    await one.save(batch(9, tenant="other", at=now))
    two = make_stores().batches  # another gateway on the same storage
    assert (await two.get("t", "batch_0003")).status == "completed"  # type: ignore[union-attr]
    assert await two.get("other", "batch_0003") is None
    assert await two.get("t", "../batch_0003") is None
    page, more = await two.list_batches("t", limit=2)
    assert [b.id for b in page] == ["batch_0004", "batch_0003"] and more
    page, more = await two.list_batches("t", after="batch_0003", limit=2)
    assert [b.id for b in page] == ["batch_0002", "batch_0001"] and more
    page, more = await two.list_batches("t", after="batch_0001", limit=2)
    assert [b.id for b in page] == ["batch_0000"] and not more
    unfinished = sorted(b.id for b in await two.unfinished())
    assert unfinished == ["batch_0000", "batch_0002", "batch_0004", "batch_0009"]
    recent = await two.recent(3)
    assert [b.id for b in recent] == ["batch_0009", "batch_0004", "batch_0003"]
    finished = batch(2, status="completed", at=now)
    await two.save(finished)
    assert "batch_0002" not in [b.id for b in await one.unfinished()]


async def test_finished_records_are_removed_after_the_retention_period(
    make_stores: StoresFactory, store_kind: str
) -> None:
    stores = make_stores(retention_s=3600.0)
    records, clock = stores.batches, stores.clock
    await records.save(batch(1, status="completed", at=clock.now - 4000))  # past the period
    await records.save(batch(2, status="in_progress", at=clock.now - 4000))  # running: kept
    await records.save(batch(3, status="completed", at=clock.now))
    if store_kind == "disk":
        assert await records.purge_expired() == 1
    else:  # a Redis TTL: gone at once when the period is over, else at its end
        assert stores.redis is not None
        tag = f"{stores.prefix}:{{{tenant_key('t')}}}"
        assert await stores.redis.pttl(f"{tag}:batch:batch_0002") == -1
        assert 3590_000 < await stores.redis.pttl(f"{tag}:batch:batch_0003") <= 3603_000
    assert await records.get("t", "batch_0001") is None
    assert await records.get("t", "batch_0002") is not None
    listed, _ = await records.list_batches("t")
    assert [b.id for b in listed] == ["batch_0003", "batch_0002"]


async def test_a_finished_record_is_never_overwritten_by_an_older_state(
    make_stores: StoresFactory,
) -> None:
    """Two gateways finalizing one batch: the one that read it before the other finished it
    cannot write ``finalizing`` (or ``cancelling``) over ``completed``."""
    one, two = make_stores(), make_stores()
    now = one.clock.now
    await one.batches.save(batch(1, status="completed", at=now))
    await two.batches.save(batch(1, status="finalizing", at=now))
    assert (await one.batches.get("t", "batch_0001")).status == "completed"  # type: ignore[union-attr]
    assert await one.batches.unfinished() == []
