"""Which tenant made each stored response, so a tenant fetches and continues only its own.

A backend (vLLM) keeps stored responses under ids anyone could send; the gateway records the
tenant of every stored response it relayed and answers another tenant's id with a 404. The
record lives where the Files API's files do: an empty file in the tenant's folder on local
disk, or a key in the shared Redis (``redis_owners.py``), so that every gateway on it answers
a tenant's own ids, and a restarted or lost gateway takes none with it.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Protocol

from foundation.files import write_atomic
from server.openai.records import read_or_none, tenant_dir, valid_id

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,120})"')


def response_id_in(data: bytes) -> str | None:
    """The first response id in a Responses API body or event stream chunk."""
    found = _RESPONSE_ID.search(data)
    return found.group(1).decode() if found is not None else None


class ResponseOwners(Protocol):
    async def remember(self, tenant: str, response_id: str) -> None: ...

    async def owns(self, tenant: str, response_id: str) -> bool: ...


class DiskResponseOwners:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, tenant: str, response_id: str) -> Path:
        return tenant_dir(self.root, tenant) / response_id

    async def remember(self, tenant: str, response_id: str) -> None:
        if valid_id(response_id):
            await asyncio.to_thread(write_atomic, self._path(tenant, response_id), b"")

    async def owns(self, tenant: str, response_id: str) -> bool:
        if not valid_id(response_id):
            return False
        found = await asyncio.to_thread(read_or_none, self._path(tenant, response_id))
        return found is not None
