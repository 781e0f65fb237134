"""Where API key records live: the small protocol the view and the admin operations use,
and its local implementation (files under the gateway's data dir).

In the habit of Litestar's ``stores`` (one async contract, a file and a Redis backend), but
with what keys need and Litestar's ``Store`` lacks: listing every record, a change feed
for the other gateways, and an append-only audit log.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol

import msgspec

from foundation.files import write_atomic
from server.identity.api_keys.records import ApiKey, AuditEntry

Changed = Callable[[str | None], Awaitable[None]]
"""Told the id of a record that changed elsewhere, or ``None``: read everything again."""


class KeyStore(Protocol):
    async def load_all(self) -> list[ApiKey]: ...

    async def get(self, key_id: str) -> ApiKey | None: ...

    async def put(self, key: ApiKey) -> None:
        """Store ``key`` and tell every gateway watching the store."""
        ...

    async def watch(self, changed: Changed) -> None:
        """Call ``changed`` for each change made elsewhere, until cancelled."""
        ...

    async def touch(self, used: Mapping[str, float]) -> None:
        """Record when keys were last used."""
        ...

    async def last_used(self) -> dict[str, float]: ...

    async def audit(self, entry: AuditEntry) -> None: ...

    async def read_audit(self, limit: int) -> list[AuditEntry]:
        """The newest ``limit`` entries, newest first."""
        ...

    async def aclose(self) -> None: ...


_records = msgspec.json.Decoder(dict[str, ApiKey])
_used = msgspec.json.Decoder(dict[str, float])
_entry = msgspec.json.Decoder(AuditEntry)


class LocalKeyStore:
    """Every record in one JSON file, rewritten atomically; the audit log a JSONL file.

    Other processes on the same data dir see a change when the file's modification time
    does (checked every ``poll_s``)."""

    def __init__(self, directory: Path, *, poll_s: float = 0.25) -> None:
        self.directory = directory
        self.path = directory / "keys.json"
        self.used_path = directory / "last-used.json"
        self.audit_path = directory / "audit.jsonl"
        self.poll_s = poll_s
        self._lock = asyncio.Lock()
        self._seen_mtime = self._mtime()

    def _mtime(self) -> int | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None

    def _read(self) -> dict[str, ApiKey]:
        try:
            return _records.decode(self.path.read_bytes())
        except FileNotFoundError:
            return {}

    async def load_all(self) -> list[ApiKey]:
        return list((await asyncio.to_thread(self._read)).values())

    async def get(self, key_id: str) -> ApiKey | None:
        return (await asyncio.to_thread(self._read)).get(key_id)

    async def put(self, key: ApiKey) -> None:
        def write() -> None:
            records = self._read()
            records[key.id] = key
            write_atomic(self.path, msgspec.json.encode(records))
            self._seen_mtime = self._mtime()

        async with self._lock:
            await asyncio.to_thread(write)

    async def watch(self, changed: Changed) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            mtime = self._mtime()
            if mtime != self._seen_mtime:
                self._seen_mtime = mtime
                await changed(None)

    async def touch(self, used: Mapping[str, float]) -> None:
        def write() -> None:
            try:
                known = _used.decode(self.used_path.read_bytes())
            except FileNotFoundError:
                known = {}
            for key_id, at in used.items():
                known[key_id] = max(at, known.get(key_id, 0.0))
            write_atomic(self.used_path, msgspec.json.encode(known))

        async with self._lock:
            await asyncio.to_thread(write)

    async def last_used(self) -> dict[str, float]:
        try:
            return _used.decode(await asyncio.to_thread(self.used_path.read_bytes))
        except FileNotFoundError:
            return {}

    async def audit(self, entry: AuditEntry) -> None:
        def append() -> None:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.audit_path, "ab") as f:
                f.write(msgspec.json.encode(entry) + b"\n")
                f.flush()
                os.fsync(f.fileno())

        async with self._lock:
            await asyncio.to_thread(append)

    async def read_audit(self, limit: int) -> list[AuditEntry]:
        def read() -> list[AuditEntry]:
            try:
                lines = self.audit_path.read_bytes().splitlines()
            except FileNotFoundError:
                return []
            return [_entry.decode(line) for line in reversed(lines[-limit:]) if line.strip()]

        return await asyncio.to_thread(read)

    async def aclose(self) -> None:
        return None
