"""Where OpenAI batch records live: the contract (:class:`BatchStore`) and its local-disk
form, ``<dir>/<tenant hash>/<id>.json``, one per batch. The Redis form is ``redis_store.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from foundation.files import write_atomic
from server.openai.batches.protocol import BatchObject
from server.openai.records import read_or_none, tenant_dir, valid_id

_decoder = msgspec.json.Decoder(BatchObject)


def decode_batch(raw: bytes | None) -> BatchObject | None:
    if raw is None:
        return None
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        return None


class BatchStore(Protocol):
    """Saves and reads each tenant's batch records; a record is only seen by its tenant."""

    async def save(self, batch: BatchObject) -> None:
        """Write the record, unless the stored one is finished and this one is not (a
        finished batch is final: a stale copy never undoes it)."""
        ...

    async def get(self, tenant: str, batch_id: str) -> BatchObject | None:
        """The tenant's batch; None when it does not exist or is another tenant's."""
        ...

    async def list_batches(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[BatchObject], bool]:
        """One page of the tenant's batches, newest first, and whether more follow."""
        ...

    async def unfinished(self) -> list[BatchObject]:
        """Every tenant's batches that are not finished yet."""
        ...

    async def recent(self, limit: int) -> list[BatchObject]:
        """Every tenant's batches, newest first, at most ``limit`` (the dashboard)."""
        ...

    async def purge_expired(self) -> int:
        """Remove finished batch records older than the retention period; returns how many."""
        ...


class DiskBatchStore:
    """A :class:`BatchStore` on local disk; every call runs off the event loop."""

    def __init__(
        self, root: Path, *, retention_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.root = root
        self.retention_s = retention_s
        self._clock = clock

    def _path(self, tenant: str, batch_id: str) -> Path:
        return tenant_dir(self.root, tenant) / f"{batch_id}.json"

    async def save(self, batch: BatchObject) -> None:
        path = self._path(batch.tenant, batch.id)

        def write() -> None:
            stored = None if batch.finished else decode_batch(read_or_none(path))
            if stored is None or not stored.finished:
                write_atomic(path, msgspec.json.encode(batch))

        await asyncio.to_thread(write)

    async def get(self, tenant: str, batch_id: str) -> BatchObject | None:
        if not valid_id(batch_id):
            return None
        batch = decode_batch(await asyncio.to_thread(read_or_none, self._path(tenant, batch_id)))
        return batch if batch is not None and batch.tenant == tenant else None

    async def list_batches(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[BatchObject], bool]:
        def scan() -> list[BatchObject]:
            found = (
                decode_batch(read_or_none(p)) for p in tenant_dir(self.root, tenant).glob("*.json")
            )
            return [b for b in found if b is not None and b.tenant == tenant]

        batches = await asyncio.to_thread(scan)
        batches.sort(key=lambda b: (b.created_at, b.id), reverse=True)
        if after is not None:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        return batches[:limit], len(batches) > limit

    async def unfinished(self) -> list[BatchObject]:
        def scan() -> list[BatchObject]:
            found = (decode_batch(read_or_none(p)) for p in self.root.glob("*/*.json"))
            return [b for b in found if b is not None and not b.finished]

        return await asyncio.to_thread(scan)

    async def recent(self, limit: int) -> list[BatchObject]:
        def scan() -> list[BatchObject]:
            found = (decode_batch(read_or_none(p)) for p in self.root.glob("*/*.json"))
            return [b for b in found if b is not None]

        batches = await asyncio.to_thread(scan)
        batches.sort(key=lambda b: (b.created_at, b.id), reverse=True)
        return batches[:limit]

    async def purge_expired(self) -> int:
        horizon = self._clock() - self.retention_s

        def purge() -> int:
            removed = 0
            for path in self.root.glob("*/*.json"):
                batch = decode_batch(read_or_none(path))
                if batch is not None and batch.finished and batch.created_at < horizon:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    removed += 1
            return removed

        return await asyncio.to_thread(purge)
