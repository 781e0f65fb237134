"""The shared batch queue of several gateways: a Redis (or Valkey) Stream with a consumer group.

Layout under the prefix ``P``:

- ``P:items``: the stream of pending items (fields ``j`` job, ``i`` index, ``t`` tenant,
  ``m`` model, ``p`` payload), read by the consumer group ``workers``;
- ``P:job:<id>``: the job's hash (tenant, model, total, created_at, started, finished_at,
  and ``traceparent`` when the submitter's trace context was kept: a job without the field
  has none);
- ``P:res:<id>``: its results, one hash field per item index, written with ``HSETNX``;
- ``P:att:<id>``: how many times each item was claimed;
- ``P:delayed``: items given back with a delay, a sorted set of their stream entry ids by
  the time (ms) they are due.

A claim is a stream delivery (``XREADGROUP``); a delivered entry stays in the group's pending
list until its result is stored. A worker renews its claims by resetting their idle time
(``XCLAIM ... JUSTID``); entries idle for longer than the lease belong to a dead worker and
are taken over by the next claim (``XAUTOCLAIM``). Storing a result, acknowledging and
deleting the entry, and finishing the job happen in one Lua script, so they are atomic.
An item given back with a delay is acknowledged (so no worker takes it over) but stays in
the stream, and its id goes into ``P:delayed``; the first claim after it is due copies it
to a fresh entry at the stream's end, in one script as well.
Finished jobs expire by Redis TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from foundation.redis_client import RedisClient, hash_tag, open_redis, request_path_options
from foundation.redis_replication import NotReplicated, ReplicaAck, replica_ack
from server.batch.queue.base import ItemResult, JobState, QueueDepth, WorkItem

_COMPLETE = """
redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[2], ARGV[4])
if redis.call('EXISTS', KEYS[3]) == 0 then
    return 0
end
local added = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if added == 1 then
    local total = tonumber(redis.call('HGET', KEYS[3], 'total'))
    if redis.call('HLEN', KEYS[1]) >= total then
        redis.call('HSET', KEYS[3], 'finished_at', ARGV[5])
        redis.call('PEXPIRE', KEYS[3], ARGV[6])
        redis.call('PEXPIRE', KEYS[1], ARGV[6])
        redis.call('DEL', KEYS[4])
    else
        redis.call('PEXPIRE', KEYS[1], ARGV[7])
    end
end
return added
"""

_REQUEUE = """
redis.call('XADD', KEYS[1], '*', 'j', ARGV[3], 'i', ARGV[4], 't', ARGV[5], 'm', ARGV[6],
    'p', ARGV[7])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""


_DELAY = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1
"""

# Moves due delayed entries to the stream's end; returns the next due time (ms) or -1.
_PROMOTE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 100)
for _, id in ipairs(due) do
    local entry = redis.call('XRANGE', KEYS[1], id, id)
    if entry[1] then
        redis.call('XADD', KEYS[1], '*', unpack(entry[1][2]))
        redis.call('XDEL', KEYS[1], id)
    end
    redis.call('ZREM', KEYS[2], id)
end
local next_due = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if next_due[2] then
    return tonumber(next_due[2])
end
return -1
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisQueue:
    """A `BatchQueue` on Redis Streams; build it with :meth:`open`."""

    group = "workers"
    max_block_s = 2.0
    """Longest single blocking read; the client's socket timeout is set above it (redis-py
    8 times out any read after 5 s by default, a blocked ``XREADGROUP`` included)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = "semcache:batch",
        lease_s: float = 30.0,
        results_ttl_s: float = 86400.0,
        max_age_s: float = 7 * 86400.0,
        clock: Callable[[], float] = time.time,
        ack: ReplicaAck | None = None,
    ) -> None:
        self.client = client
        self.ack = ack
        """Confirms each submit on replicas before it is acknowledged (none: at once)."""
        self.prefix = prefix = hash_tag(prefix)
        self.stream = f"{prefix}:items"
        self.delayed = f"{prefix}:delayed"
        self.lease_s = lease_s
        self.results_ttl_s = results_ttl_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._complete = client.register_script(_COMPLETE)
        self._requeue = client.register_script(_REQUEUE)
        self._delay = client.register_script(_DELAY)
        self._promote = client.register_script(_PROMOTE)

    @classmethod
    async def open(
        cls, url: str, *, replicas: int = 0, replica_timeout_s: float = 1.0, **kwargs: Any
    ) -> RedisQueue:
        """A queue on ``url``; a submit returns only once ``replicas`` replicas hold it."""
        client = open_redis(url, **request_path_options(cls.max_block_s + 10.0))
        ack = replica_ack(client, url, replicas=replicas, timeout_s=replica_timeout_s)
        queue = cls(client, ack=ack, **kwargs)
        try:
            await client.xgroup_create(queue.stream, cls.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                await client.aclose()
                raise
        return queue

    def _job_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def _res_key(self, job_id: str) -> str:
        return f"{self.prefix}:res:{job_id}"

    def _att_key(self, job_id: str) -> str:
        return f"{self.prefix}:att:{job_id}"

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, int(seconds * 1000))

    # -- BatchQueue -----------------------------------------------------------------

    async def depth(self) -> QueueDepth:
        # Finished entries are deleted from the stream: what is left is waiting (delayed
        # ones included) or leased.
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.xlen(self.stream)
            pipe.xpending(self.stream, self.group)
            pipe.xrange(self.stream, count=1)
            items, pending, first = await pipe.execute()
        oldest = None
        if first:
            first_ms = int(_text(first[0][0]).split("-")[0])
            oldest = max(self._clock() - first_ms / 1000.0, 0.0)
        leased = int(pending["pending"]) if isinstance(pending, dict) else 0
        return QueueDepth(items=int(items), leased=leased, oldest_age_s=oldest)

    async def submit(
        self,
        job_id: str,
        tenant: str,
        model: str,
        payloads: Sequence[bytes],
        *,
        trace_context: str | None = None,
    ) -> None:
        job = self._job_key(job_id)
        record: dict[FieldT, EncodableT] = {
            "tenant": tenant,
            "model": model,
            "total": len(payloads),
            "created_at": repr(self._clock()),
        }
        if trace_context:
            record["traceparent"] = trace_context
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(job, mapping=record)
            pipe.pexpire(job, self._ms(self.max_age_s))
            for i, payload in enumerate(payloads):
                pipe.xadd(self.stream, {"j": job_id, "i": i, "t": tenant, "m": model, "p": payload})
            written = await pipe.execute()
        if self.ack is None:
            return
        try:
            await self.ack.confirm(job)
        except NotReplicated:
            # Refused, so not run either: a failover may still have lost it, or not.
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.xdel(self.stream, *written[2:])
                pipe.delete(job)
                await pipe.execute()
            raise

    async def claim(self, consumer: str, limit: int, wait_s: float) -> list[WorkItem]:
        if limit <= 0:
            return []
        entries = await self._take(consumer, limit, wait_s)
        if not entries:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for _id, fields in entries:
                job_id, index = _text(fields[b"j"]), _text(fields[b"i"])
                pipe.hincrby(self._att_key(job_id), index, 1)
                pipe.pexpire(self._att_key(job_id), self._ms(self.max_age_s))
                pipe.hset(self._job_key(job_id), "started", 1)
                pipe.hget(self._job_key(job_id), "traceparent")
            answers = await pipe.execute()
        return [
            WorkItem(
                job_id=_text(fields[b"j"]),
                index=int(fields[b"i"]),
                tenant=_text(fields[b"t"]),
                model=_text(fields[b"m"]),
                payload=bytes(fields[b"p"]),
                attempts=int(answers[4 * n]),
                receipt=_text(entry_id),
                trace_context=_text(answers[4 * n + 3]) if answers[4 * n + 3] else None,
            )
            for n, (entry_id, fields) in enumerate(entries)
        ]

    async def _take(self, consumer: str, limit: int, wait_s: float) -> list[tuple[Any, Any]]:
        """Stream entries for ``consumer``: taken over from dead workers, or new (delayed ones
        that came due included), waiting at most ``wait_s`` for them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait_s, 0.0)
        while True:
            now_ms = int(self._clock() * 1000)
            next_due = int(await self._promote(keys=[self.stream, self.delayed], args=[now_ms]))
            # Entries idle past the lease belong to a dead (or stuck) worker: take them first.
            reclaimed = await self.client.xautoclaim(
                self.stream,
                self.group,
                consumer,
                min_idle_time=self._ms(self.lease_s),
                start_id="0-0",
                count=limit,
            )
            entries: list[tuple[Any, Any]] = [e for e in reclaimed[1] if e and e[1]]
            if entries:
                return entries
            # A blocking read: an idle worker costs nothing and wakes on the next XADD, or
            # when a delayed item comes due. Each read ends after one lease at the latest, to
            # take over the entries of dead workers.
            wait = min(deadline - loop.time(), self.lease_s, self.max_block_s)
            if next_due >= 0:
                wait = min(wait, (next_due - now_ms) / 1000.0)
            read: Any = await self.client.xreadgroup(
                self.group,
                consumer,
                {self.stream: ">"},
                count=limit,
                block=self._ms(wait) if wait > 0 else None,
            )
            for _stream, delivered in read or []:
                entries.extend(e for e in delivered if e and e[1])
            if entries or loop.time() >= deadline:
                return entries

    async def extend(self, consumer: str, items: Sequence[WorkItem]) -> None:
        if items:
            await self.client.xclaim(
                self.stream,
                self.group,
                consumer,
                min_idle_time=0,
                message_ids=[item.receipt for item in items],
                justid=True,
            )

    async def complete(self, item: WorkItem, body: bytes) -> bool:
        added = await self._complete(
            keys=[
                self._res_key(item.job_id),
                self.stream,
                self._job_key(item.job_id),
                self._att_key(item.job_id),
            ],
            args=[
                item.index,
                body,
                self.group,
                item.receipt,
                repr(self._clock()),
                self._ms(self.results_ttl_s),
                self._ms(self.max_age_s),
            ],
        )
        return bool(added)

    async def retry(self, item: WorkItem, delay_s: float) -> None:
        if delay_s > 0:
            due_ms = int((self._clock() + delay_s) * 1000)
            await self._delay(
                keys=[self.stream, self.delayed], args=[self.group, item.receipt, due_ms]
            )
            return
        await self._requeue(
            keys=[self.stream],
            args=[
                self.group,
                item.receipt,
                item.job_id,
                item.index,
                item.tenant,
                item.model,
                item.payload,
            ],
        )

    async def job(self, job_id: str) -> JobState | None:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._job_key(job_id))
            pipe.hlen(self._res_key(job_id))
            fields, completed = await pipe.execute()
        if not fields or b"total" not in fields:
            return None
        finished = fields.get(b"finished_at")
        return JobState(
            id=job_id,
            tenant=_text(fields[b"tenant"]),
            model=_text(fields[b"model"]),
            total=int(fields[b"total"]),
            completed=int(completed),
            started=b"started" in fields,
            created_at=float(fields[b"created_at"]),
            finished_at=float(finished) if finished is not None else None,
        )

    async def results(self, job_id: str) -> list[ItemResult]:
        stored: dict[Any, Any] = await self.client.hgetall(self._res_key(job_id))
        out = [ItemResult(index=int(k), body=bytes(v)) for k, v in stored.items()]
        return sorted(out, key=lambda r: r.index)

    async def purge_expired(self) -> int:
        return 0  # finished and abandoned jobs expire by Redis TTL

    async def aclose(self) -> None:
        if self.ack is not None:
            await self.ack.aclose()
        await self.client.aclose()
