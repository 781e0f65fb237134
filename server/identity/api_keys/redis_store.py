"""API key records in the shared Redis, with pub/sub so every gateway sees a change at once.

Keys: ``<prefix>:apikeys:records`` (a hash, id → the record as JSON), ``…:used`` (id →
last use), ``…:audit`` (a list, newest first, trimmed to ``audit_keep``); every ``put``
publishes the id on ``…:changed``. A gateway whose subscription was lost reads everything
again when it is back (and every ``resync_s`` anyway, in the view).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from foundation.redis_client import RedisClient, open_redis
from foundation.redis_pubsub import follow_channel
from server.identity.api_keys.records import ApiKey, AuditEntry
from server.identity.api_keys.store import Changed

log = logging.getLogger("semcache.keys")

_record = msgspec.json.Decoder(ApiKey)
_entry = msgspec.json.Decoder(AuditEntry)


class RedisKeyStore:
    def __init__(
        self, url: str, prefix: str, *, audit_keep: int = 100_000, timeout_s: float = 2.0
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        base = f"{prefix}:apikeys"
        self.records_key = f"{base}:records"
        self.used_key = f"{base}:used"
        self.audit_key = f"{base}:audit"
        self.channel = f"{base}:changed"
        self.audit_keep = audit_keep
        self.redis: RedisClient = open_redis(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )

    async def load_all(self) -> list[ApiKey]:
        values: dict[Any, Any] = await self.redis.hgetall(self.records_key)
        return [_record.decode(v) for v in values.values()]

    async def get(self, key_id: str) -> ApiKey | None:
        raw: Any = await self.redis.hget(self.records_key, key_id)
        return None if raw is None else _record.decode(raw)

    async def put(self, key: ApiKey) -> None:
        # Two commands, not one transaction: a cluster runs no PUBLISH inside MULTI, and a
        # message lost between them is caught up by the views' periodic resync.
        await self.redis.hset(self.records_key, key.id, msgspec.json.encode(key))
        await self.redis.publish(self.channel, key.id)

    async def watch(self, changed: Changed) -> None:
        async def message(data: bytes) -> None:
            await changed(data.decode())

        async def subscribed() -> None:
            await changed(None)  # whatever changed while we were not subscribed

        await follow_channel(
            self.url,
            self.channel,
            message,
            on_subscribed=subscribed,
            log=log,
            timeout_s=self.timeout_s,
        )

    async def touch(self, used: Mapping[str, float]) -> None:
        if used:
            mapping: dict[Any, Any] = dict(used)
            await self.redis.hset(self.used_key, mapping=mapping)

    async def last_used(self) -> dict[str, float]:
        values: dict[Any, Any] = await self.redis.hgetall(self.used_key)
        return {k.decode(): float(v) for k, v in values.items()}

    async def audit(self, entry: AuditEntry) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.lpush(self.audit_key, msgspec.json.encode(entry))
            p.ltrim(self.audit_key, 0, self.audit_keep - 1)
            await p.execute()

    async def read_audit(self, limit: int) -> list[AuditEntry]:
        raw: list[Any] = await self.redis.lrange(self.audit_key, 0, limit - 1)
        return [_entry.decode(v) for v in raw]

    async def aclose(self) -> None:
        await self.redis.aclose()
