"""A Litestar ``Store`` on a local directory whose files are named by their keys.

A key is a relative path (``<tenant hash>/<id>``): its records stay readable on disk, one
folder per tenant, as the gateway's other local records are. A file holds Litestar's
``StorageObject`` (the value and its expiry, msgpack), written atomically. A file that is no
``StorageObject`` (a record written before this store, such as an empty marker file) reads
as its bytes, never expiring.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from datetime import timedelta
from pathlib import Path

import msgspec
from litestar.stores.base import NamespacedStore, StorageObject

from foundation.files import write_atomic

_SEGMENT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
"""One part of a key: no separator, no leading dot (``..``, the atomic writes' temp files)."""


def valid_key(key: str) -> bool:
    """Whether ``key`` names a file under the store (relative, no ``..``, no odd characters)."""
    return all(_SEGMENT.match(part) for part in key.split("/"))


def _load(path: Path) -> StorageObject | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return StorageObject.from_bytes(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return StorageObject(expires_at=None, data=raw)  # written before this store


class DirectoryStore(NamespacedStore):
    """Keys are paths under ``root``; a namespace is a folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def with_namespace(self, namespace: str) -> DirectoryStore:
        return DirectoryStore(self._path(namespace))

    def _path(self, key: str) -> Path:
        if not valid_key(key):
            raise ValueError(f"not a store key: {key!r}")
        return self.root / key

    async def _live(self, key: str) -> StorageObject | None:
        path = self._path(key)
        found = await asyncio.to_thread(_load, path)
        if found is not None and found.expired:
            await asyncio.to_thread(path.unlink, missing_ok=True)
            return None
        return found

    async def set(
        self, key: str, value: str | bytes, expires_in: int | timedelta | None = None
    ) -> None:
        data = value.encode() if isinstance(value, str) else value
        record = StorageObject.new(data=data, expires_in=expires_in)
        await asyncio.to_thread(write_atomic, self._path(key), record.to_bytes())

    async def get(self, key: str, renew_for: int | timedelta | None = None) -> bytes | None:
        found = await self._live(key)
        if found is None:
            return None
        if renew_for and found.expires_at is not None:
            await self.set(key, found.data, expires_in=renew_for)
        return found.data

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, missing_ok=True)

    async def delete_all(self) -> None:
        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(self.root)

        await asyncio.to_thread(remove)

    async def exists(self, key: str) -> bool:
        return await self._live(key) is not None

    async def expires_in(self, key: str) -> int | None:
        found = await self._live(key)
        return None if found is None or found.expires_at is None else found.expires_in
