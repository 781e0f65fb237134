"""Pool changes in the shared Redis, with pub/sub so every gateway applies one at once.

Keys: ``<prefix>:pools:members`` (a hash, ``"<backend> <role> <url>"`` → the change as
JSON); every ``put`` publishes the key on ``<prefix>:pools:changed``. A gateway whose
subscription was lost reads everything again when it is back (and every ``resync_s`` anyway).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from foundation.redis_client import RedisClient, open_redis
from foundation.redis_pubsub import follow_channel
from server.pools.records import MemberChange
from server.pools.store import Changed

log = logging.getLogger("semcache.pools")

_change = msgspec.json.Decoder(MemberChange)


class RedisMembershipStore:
    shared = True

    def __init__(self, url: str, prefix: str, *, timeout_s: float = 2.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.members_key = f"{prefix}:pools:members"
        self.channel = f"{prefix}:pools:changed"
        self.redis: RedisClient = open_redis(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )

    async def load_all(self) -> list[MemberChange]:
        values: dict[Any, Any] = await self.redis.hgetall(self.members_key)
        out: list[MemberChange] = []
        for key, value in values.items():
            try:
                out.append(_change.decode(value))
            except msgspec.DecodeError:
                log.error("pool change %r in Redis is not readable: skipped", key)
        return out

    async def put(self, change: MemberChange) -> None:
        # Two commands, not one transaction: a cluster runs no PUBLISH inside MULTI, and a
        # message lost between them is caught up by the periodic resync.
        await self.redis.hset(self.members_key, change.key, msgspec.json.encode(change))
        await self.redis.publish(self.channel, change.key)

    async def watch(self, changed: Changed) -> None:
        async def message(_: bytes) -> None:
            await changed()

        await follow_channel(
            self.url,
            self.channel,
            message,
            on_subscribed=changed,
            log=log,
            timeout_s=self.timeout_s,
        )

    async def aclose(self) -> None:
        await self.redis.aclose()
