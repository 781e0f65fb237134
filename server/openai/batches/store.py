"""Batch records on local disk: ``<dir>/<tenant hash>/<id>.json``, one per batch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from server.openai.batches.protocol import BatchObject
from server.openai.records import read_or_none, tenant_dir, valid_id, write_atomic

_decoder = msgspec.json.Decoder(BatchObject)


def _decode(raw: bytes | None) -> BatchObject | None:
    if raw is None:
        return None
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        return None


class BatchStore:
    """Saves and reads one tenant's batch records; every call runs off the event loop."""

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
        await asyncio.to_thread(write_atomic, path, msgspec.json.encode(batch))

    async def get(self, tenant: str, batch_id: str) -> BatchObject | None:
        """The tenant's batch; None when it does not exist or is another tenant's."""
        if not valid_id(batch_id):
            return None
        batch = _decode(await asyncio.to_thread(read_or_none, self._path(tenant, batch_id)))
        return batch if batch is not None and batch.tenant == tenant else None

    async def list_batches(self, tenant: str) -> list[BatchObject]:
        """The tenant's batches, newest first."""

        def scan() -> list[BatchObject]:
            found = (_decode(read_or_none(p)) for p in tenant_dir(self.root, tenant).glob("*.json"))
            return [b for b in found if b is not None and b.tenant == tenant]

        batches = await asyncio.to_thread(scan)
        batches.sort(key=lambda b: (b.created_at, b.id), reverse=True)
        return batches

    async def unfinished(self) -> list[BatchObject]:
        """Every tenant's batches that are not finished yet."""

        def scan() -> list[BatchObject]:
            found = (_decode(read_or_none(p)) for p in self.root.glob("*/*.json"))
            return [b for b in found if b is not None and not b.finished]

        return await asyncio.to_thread(scan)

    async def recent(self, limit: int) -> list[BatchObject]:
        """Every tenant's batches, newest first, at most ``limit`` (the dashboard)."""

        def scan() -> list[BatchObject]:
            found = (_decode(read_or_none(p)) for p in self.root.glob("*/*.json"))
            return [b for b in found if b is not None]

        batches = await asyncio.to_thread(scan)
        batches.sort(key=lambda b: (b.created_at, b.id), reverse=True)
        return batches[:limit]

    async def purge_expired(self) -> int:
        """Remove finished batch records older than the retention period."""
        horizon = self._clock() - self.retention_s

        def purge() -> int:
            removed = 0
            for path in self.root.glob("*/*.json"):
                batch = _decode(read_or_none(path))
                if batch is not None and batch.finished and batch.created_at < horizon:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    removed += 1
            return removed

        return await asyncio.to_thread(purge)
