"""The owners of stored responses in the shared Redis: ``P:{T}:resp:<id>`` (empty, for the
tenant hash ``T``), expiring ``retention_s`` after the response was made."""

from __future__ import annotations

from foundation.redis_client import RedisClient
from server.openai.records import valid_id
from server.openai.redis_records import ms, tenant_tag


class RedisResponseOwners:
    """A ``ResponseOwners`` in Redis; the client is the caller's (it closes it)."""

    def __init__(self, client: RedisClient, *, prefix: str, retention_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.retention_s = retention_s

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{tenant_tag(self.prefix, tenant)}:resp:{response_id}"

    async def remember(self, tenant: str, response_id: str) -> None:
        if valid_id(response_id):
            await self.client.set(self._key(tenant, response_id), b"", px=ms(self.retention_s))

    async def owns(self, tenant: str, response_id: str) -> bool:
        if not valid_id(response_id):
            return False
        return bool(await self.client.exists(self._key(tenant, response_id)))
