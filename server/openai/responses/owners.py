"""Which tenant made each stored response, so a tenant fetches and continues only its own.

A backend (vLLM) keeps stored responses under ids anyone could send; the gateway records the
tenant of every stored response it relayed and answers another tenant's id with a 404. The
record is the key ``<tenant hash>/<id>`` of the OpenAI site's ``resp`` store
(``server/stores/``): an empty file in the tenant's folder on local disk, or a key in the
shared Redis (``P:{T}:resp:<id>``), so that every gateway on it answers a tenant's own ids,
and a restarted or lost gateway takes none with it.
"""

from __future__ import annotations

import re
from datetime import timedelta

from litestar.stores.base import Store

from server.openai.records import tenant_key, valid_id

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,120})"')


def response_id_in(data: bytes) -> str | None:
    """The first response id in a Responses API body or event stream chunk."""
    found = _RESPONSE_ID.search(data)
    return found.group(1).decode() if found is not None else None


class ResponseOwners:
    """The owners in ``store``, each kept ``retention_s`` (``None``: for good)."""

    def __init__(self, store: Store, *, retention_s: float | None) -> None:
        self.store = store
        self.expires_in = timedelta(seconds=retention_s) if retention_s is not None else None

    async def remember(self, tenant: str, response_id: str) -> None:
        if valid_id(response_id):
            await self.store.set(f"{tenant_key(tenant)}/{response_id}", b"", self.expires_in)

    async def owns(self, tenant: str, response_id: str) -> bool:
        if not valid_id(response_id):
            return False
        return await self.store.exists(f"{tenant_key(tenant)}/{response_id}")
