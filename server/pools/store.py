"""Where pool changes live: the small protocol :class:`PoolMembership` uses, and its local
implementation (one JSON file under the gateway's data dir)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import msgspec

from foundation.files import write_atomic
from server.pools.records import MemberChange

Changed = Callable[[], Awaitable[None]]
"""Told that the store changed elsewhere (or may have): read it again."""


class MembershipStore(Protocol):
    shared: bool
    """Other gateways read it too (their changes arrive through :meth:`watch`)."""

    async def load_all(self) -> list[MemberChange]: ...

    async def put(self, change: MemberChange) -> None:
        """Keep ``change`` (replacing the server's earlier one) and tell the other gateways."""
        ...

    async def watch(self, changed: Changed) -> None:
        """Call ``changed`` after each change made elsewhere, until cancelled."""
        ...

    async def aclose(self) -> None: ...


_records = msgspec.json.Decoder(dict[str, MemberChange])


class LocalMembershipStore:
    """Every change in one JSON file (key → change), rewritten atomically."""

    shared = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = asyncio.Lock()

    def _read(self) -> dict[str, MemberChange]:
        try:
            return _records.decode(self.path.read_bytes())
        except FileNotFoundError:
            return {}

    async def load_all(self) -> list[MemberChange]:
        return list((await asyncio.to_thread(self._read)).values())

    async def put(self, change: MemberChange) -> None:
        async with self._lock:
            records = await asyncio.to_thread(self._read)
            records[change.key] = change
            await asyncio.to_thread(write_atomic, self.path, msgspec.json.encode(records))

    async def watch(self, changed: Changed) -> None:
        await asyncio.Event().wait()  # this gateway alone writes the file

    async def aclose(self) -> None:
        return None
