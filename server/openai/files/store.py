"""Where the Files API keeps its files: the contract (:class:`FileStore`) and its local-disk
form, ``<dir>/<tenant hash>/<id>.json`` (the file object) and ``<id>.data`` (the content),
removed ``retention_s`` after their creation. The Redis form is ``redis_store.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from foundation.files import write_atomic
from server.openai.files.protocol import FileObject, Purpose
from server.openai.records import new_id, read_or_none, tenant_dir, valid_id

_decoder = msgspec.json.Decoder(FileObject)


class FileStore(Protocol):
    """Stores, lists and removes each tenant's files; a file is only ever seen by its tenant
    and not at all once expired."""

    retention_s: float

    async def create(
        self,
        tenant: str,
        filename: str,
        purpose: Purpose,
        data: bytes,
        *,
        file_id: str | None = None,
    ) -> FileObject:
        """Store ``data``; a given ``file_id`` is overwritten (batch outputs are rewritten
        whole when a finalization runs again)."""
        ...

    async def delete(self, tenant: str, file_id: str) -> bool: ...

    async def purge_expired(self) -> int:
        """Remove every tenant's expired files; returns how many."""
        ...

    async def get(self, tenant: str, file_id: str) -> FileObject | None:
        """The tenant's file ``file_id``; None when it does not exist, expired or is another
        tenant's."""
        ...

    async def content(self, tenant: str, file_id: str) -> bytes | None: ...

    async def list_files(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        order: str = "desc",
        after: str | None = None,
        limit: int = 10000,
    ) -> tuple[list[FileObject], bool]:
        """One page of the tenant's files, newest first by default, and whether more follow."""
        ...


class DiskFileStore:
    """A :class:`FileStore` on local disk; every call runs off the event loop."""

    def __init__(
        self, root: Path, *, retention_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.root = root
        self.retention_s = retention_s
        self._clock = clock

    def _paths(self, tenant: str, file_id: str) -> tuple[Path, Path]:
        folder = tenant_dir(self.root, tenant)
        return folder / f"{file_id}.json", folder / f"{file_id}.data"

    def _live(self, obj: FileObject) -> bool:
        return obj.live(self._clock())

    # -- writes ------------------------------------------------------------------------

    async def create(
        self,
        tenant: str,
        filename: str,
        purpose: Purpose,
        data: bytes,
        *,
        file_id: str | None = None,
    ) -> FileObject:
        """Store ``data``; a given ``file_id`` is overwritten (batch outputs are rewritten
        whole when a finalization runs again)."""
        now = self._clock()
        obj = FileObject.stored(
            tenant,
            filename,
            purpose,
            len(data),
            now=now,
            retention_s=self.retention_s,
            file_id=file_id or new_id("file-"),
        )
        meta, content = self._paths(tenant, obj.id)

        def write() -> None:
            write_atomic(content, data)
            write_atomic(meta, msgspec.json.encode(obj))  # the file exists once this is written

        await asyncio.to_thread(write)
        return obj

    async def delete(self, tenant: str, file_id: str) -> bool:
        if not valid_id(file_id):
            return False
        meta, content = self._paths(tenant, file_id)

        def remove() -> bool:
            existed = meta.exists()
            for path in (meta, content):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return existed

        return await asyncio.to_thread(remove)

    async def purge_expired(self) -> int:
        """Remove every tenant's expired files; returns how many."""

        def purge() -> int:
            removed = 0
            for meta in self.root.glob("*/*.json"):
                raw = read_or_none(meta)
                try:
                    obj = _decoder.decode(raw) if raw is not None else None
                except msgspec.DecodeError:
                    obj = None
                if obj is None or self._live(obj):
                    continue
                for path in (meta, meta.with_suffix(".data")):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed += 1
            return removed

        return await asyncio.to_thread(purge)

    # -- reads -------------------------------------------------------------------------

    async def get(self, tenant: str, file_id: str) -> FileObject | None:
        """The tenant's file ``file_id``; None when it does not exist, expired or is another
        tenant's."""
        if not valid_id(file_id):
            return None
        raw = await asyncio.to_thread(read_or_none, self._paths(tenant, file_id)[0])
        if raw is None:
            return None
        obj = _decoder.decode(raw)
        return obj if obj.tenant == tenant and self._live(obj) else None

    async def content(self, tenant: str, file_id: str) -> bytes | None:
        if await self.get(tenant, file_id) is None:
            return None
        return await asyncio.to_thread(read_or_none, self._paths(tenant, file_id)[1])

    async def list_files(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        order: str = "desc",
        after: str | None = None,
        limit: int = 10000,
    ) -> tuple[list[FileObject], bool]:
        """One page of the tenant's files, newest first by default, and whether more follow."""

        def scan() -> list[FileObject]:
            out = []
            for meta in tenant_dir(self.root, tenant).glob("*.json"):
                raw = read_or_none(meta)
                if raw is None:
                    continue
                with contextlib.suppress(msgspec.DecodeError):
                    out.append(_decoder.decode(raw))
            return out

        objs = [
            o
            for o in await asyncio.to_thread(scan)
            if o.tenant == tenant and self._live(o) and (purpose is None or o.purpose == purpose)
        ]
        objs.sort(key=lambda o: (o.created_at, o.id), reverse=order != "asc")
        if after is not None:
            ids = [o.id for o in objs]
            objs = objs[ids.index(after) + 1 :] if after in ids else []
        return objs[:limit], len(objs) > limit
