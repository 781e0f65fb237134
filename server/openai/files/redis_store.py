"""The Files API's files in Redis, shared by every gateway on it.

Under the prefix ``P``, for the tenant hash ``T`` (a Redis Cluster hash tag):

- ``P:{T}:file:<id>``: a hash of the file object (``meta``, JSON) and its bytes (``data``),
  expiring ``retention_s`` after its creation (a Redis TTL);
- ``P:{T}:files``: the tenant's index, a sorted set of ids scored by creation time; ids
  whose file expired are dropped when a listing meets them or a new file is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from foundation.redis_client import RedisClient
from foundation.redis_replication import NotReplicated, ReplicaAck
from server.openai.files.protocol import FileObject, Purpose
from server.openai.records import new_id, valid_id
from server.openai.redis_records import ms, page, raw, tenant_tag

_decoder = msgspec.json.Decoder(FileObject)

INDEX_MARGIN_S = 60.0
"""How much longer a tenant's index lives than its newest file."""


class RedisFileStore:
    """A ``FileStore`` in Redis; the client is the caller's (it closes it)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str,
        retention_s: float,
        clock: Callable[[], float] = time.time,
        ack: ReplicaAck | None = None,
    ) -> None:
        self.client = client
        self.ack = ack
        """Confirms each upload on replicas before it is acknowledged (none: at once)."""
        self.prefix = prefix
        self.retention_s = retention_s
        self._clock = clock

    def _key(self, tenant: str, file_id: str) -> str:
        return f"{tenant_tag(self.prefix, tenant)}:file:{file_id}"

    def _index(self, tenant: str) -> str:
        return f"{tenant_tag(self.prefix, tenant)}:files"

    def _decode(self, tenant: str, raw: bytes | None) -> FileObject | None:
        """The stored object when it is the tenant's and alive, else None."""
        if raw is None:
            return None
        try:
            obj = _decoder.decode(raw)
        except msgspec.DecodeError:
            return None
        return obj if obj.tenant == tenant and obj.live(self._clock()) else None

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
        key, index = self._key(tenant, obj.id), self._index(tenant)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": msgspec.json.encode(obj), "data": data})
            pipe.pexpire(key, ms(self.retention_s))
            pipe.zadd(index, {obj.id: obj.created_at})
            pipe.zremrangebyscore(index, "-inf", f"({int(now - self.retention_s)}")
            pipe.pexpire(index, ms(self.retention_s + INDEX_MARGIN_S))
            await pipe.execute()
        if self.ack is not None:
            try:
                await self.ack.confirm(key)
            except NotReplicated:
                # Refused, so not kept either: a failover may still have lost it, or not.
                async with self.client.pipeline(transaction=True) as pipe:
                    pipe.delete(key)
                    pipe.zrem(index, obj.id)
                    await pipe.execute()
                raise
        return obj

    async def delete(self, tenant: str, file_id: str) -> bool:
        if not valid_id(file_id) or await self.get(tenant, file_id) is None:
            return False
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(tenant, file_id))
            pipe.zrem(self._index(tenant), file_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def purge_expired(self) -> int:
        """Nothing to do: Redis removes expired files itself (their TTL)."""
        return 0

    # -- reads -------------------------------------------------------------------------

    async def get(self, tenant: str, file_id: str) -> FileObject | None:
        if not valid_id(file_id):
            return None
        return self._decode(tenant, raw(await self.client.hget(self._key(tenant, file_id), "meta")))

    async def content(self, tenant: str, file_id: str) -> bytes | None:
        if not valid_id(file_id):
            return None
        meta, data = await self.client.hmget(self._key(tenant, file_id), ["meta", "data"])
        return raw(data) if self._decode(tenant, raw(meta)) is not None else None

    async def list_files(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        order: str = "desc",
        after: str | None = None,
        limit: int = 10000,
    ) -> tuple[list[FileObject], bool]:
        async def load(ids: list[str]) -> list[FileObject | None]:
            async with self.client.pipeline(transaction=False) as pipe:
                for file_id in ids:
                    pipe.hget(self._key(tenant, file_id), "meta")
                raws = await pipe.execute()
            return [self._decode(tenant, raw(r)) for r in raws]

        return await page(
            self.client,
            self._index(tenant),
            load,
            after=after,
            limit=limit,
            descending=order != "asc",
            keep=lambda o: purpose is None or o.purpose == purpose,
        )
