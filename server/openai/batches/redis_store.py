"""OpenAI batch records in Redis, shared by every gateway on it (any gateway answers for
any batch, whichever one created it).

Under the prefix ``P``, for the tenant hash ``T`` (a Redis Cluster hash tag):

- ``P:{T}:batch:<id>``: a hash of the batch object (``j``, JSON) and whether it is finished
  (``f``); a finished record expires ``retention_s`` after the batch's creation (a Redis
  TTL), an unfinished one never does;
- ``P:{T}:batches``: the tenant's index, a sorted set of ids scored by creation time;
- ``P:batches:open``: the set of unfinished batches (``T/<id>``), which the sweep finalizes;
- ``P:batches:recent``: the newest batches of every tenant (``T/<id>``), for the dashboard.

A record and its index change together in one script. The two global keys are on shards of
their own and are written apart: a batch joins ``open`` before its record is written and
leaves it after, so the sweep may meet a finished or missing batch there (and drops it)
but never misses an unfinished one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from foundation.redis_client import RedisClient
from foundation.redis_replication import ReplicaAck
from server.openai.batches.protocol import COMPLETION_WINDOWS, BatchObject
from server.openai.batches.store import decode_batch
from server.openai.records import tenant_key, valid_id
from server.openai.redis_records import ms, page, raw, tenant_tag, text

RECENT_KEEP = 1000
"""How many batches ``P:batches:recent`` keeps."""

# A finished record is final: a gateway that read the batch before another one finished it
# cannot write an older state over the finished one.
_SAVE = """
if ARGV[2] == '0' and redis.call('HGET', KEYS[1], 'f') == '1' then
    return 0
end
redis.call('HSET', KEYS[1], 'j', ARGV[1], 'f', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
if ARGV[2] == '0' then
    redis.call('PERSIST', KEYS[1])
elseif tonumber(ARGV[5]) > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
else
    redis.call('DEL', KEYS[1])
    redis.call('ZREM', KEYS[2], ARGV[3])
end
return 1
"""


class RedisBatchStore:
    """A ``BatchStore`` in Redis; the client is the caller's (it closes it)."""

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
        """Confirms each saved record on replicas before the save returns (none: at once)."""
        self.prefix = prefix
        self.retention_s = retention_s
        self._clock = clock
        self._open = f"{prefix}:batches:open"
        self._recent = f"{prefix}:batches:recent"
        self._save = client.register_script(_SAVE)

    def _key(self, tenant: str, batch_id: str) -> str:
        return f"{tenant_tag(self.prefix, tenant)}:batch:{batch_id}"

    def _index(self, tenant: str) -> str:
        return f"{tenant_tag(self.prefix, tenant)}:batches"

    def _member_key(self, member: str) -> str:
        """The record key of a global set's member ``T/<id>``."""
        tenant_hash, _, batch_id = member.partition("/")
        return f"{self.prefix}:{{{tenant_hash}}}:batch:{batch_id}"

    async def _load(self, keys: list[str]) -> list[BatchObject | None]:
        async with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(key, "j")
            return [decode_batch(raw(r)) for r in await pipe.execute()]

    async def save(self, batch: BatchObject) -> None:
        member = f"{tenant_key(batch.tenant)}/{batch.id}"
        if not batch.finished:
            await self.client.sadd(self._open, member)
        # the index outlives its finished records; unfinished ones are saved again at least
        # once per completion window (they end by then)
        index_ttl = self.retention_s + 2 * max(COMPLETION_WINDOWS.values())
        record_ttl = batch.created_at + self.retention_s - self._clock()
        saved = await self._save(
            keys=[self._key(batch.tenant, batch.id), self._index(batch.tenant)],
            args=[
                msgspec.json.encode(batch),
                "1" if batch.finished else "0",
                batch.id,
                batch.created_at,
                ms(record_ttl) if record_ttl > 0 else 0,
                ms(index_ttl),
            ],
        )
        async with self.client.pipeline(transaction=False) as pipe:
            if batch.finished or not saved:  # not saved: the stored record is finished
                pipe.srem(self._open, member)
            pipe.zadd(self._recent, {member: batch.created_at})
            pipe.zremrangebyrank(self._recent, 0, -RECENT_KEEP - 1)
            await pipe.execute()
        if self.ack is not None:  # the record, and the open set the sweep finishes it from
            await self.ack.confirm(self._key(batch.tenant, batch.id))
            if not batch.finished:
                await self.ack.confirm(self._open)

    async def get(self, tenant: str, batch_id: str) -> BatchObject | None:
        if not valid_id(batch_id):
            return None
        batch = decode_batch(raw(await self.client.hget(self._key(tenant, batch_id), "j")))
        return batch if batch is not None and batch.tenant == tenant else None

    async def list_batches(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[BatchObject], bool]:
        async def load(ids: list[str]) -> list[BatchObject | None]:
            found = await self._load([self._key(tenant, i) for i in ids])
            return [b if b is not None and b.tenant == tenant else None for b in found]

        return await page(self.client, self._index(tenant), load, after=after, limit=limit)

    async def unfinished(self) -> list[BatchObject]:
        members = [text(m) for m in await self.client.smembers(self._open)]
        found = await self._load([self._member_key(m) for m in members])
        done = [m for m, b in zip(members, found, strict=True) if b is None or b.finished]
        if done:
            await self.client.srem(self._open, *done)
        return [b for b in found if b is not None and not b.finished]

    async def recent(self, limit: int) -> list[BatchObject]:
        async def load(members: list[str]) -> list[BatchObject | None]:
            return await self._load([self._member_key(m) for m in members])

        batches, _ = await page(self.client, self._recent, load, after=None, limit=limit)
        return batches

    async def purge_expired(self) -> int:
        """Nothing to do: Redis removes expired records itself (their TTL)."""
        return 0
