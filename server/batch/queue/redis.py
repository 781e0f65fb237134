"""The shared batch queue of several gateways: a Redis (or Valkey) Stream with a consumer group.

Layout under the prefix ``P``:

- ``P:items``: the stream of pending items (fields ``j`` job, ``i`` index, ``t`` tenant,
  ``m`` model, ``p`` payload), read by the consumer group ``workers``;
- ``P:job:<id>``: the job's hash (tenant, model, total, created_at, started, finished_at,
  and ``traceparent`` when the submitter's trace context was kept: a job without the field
  has none);
- ``P:res:<id>``: its results, one hash field per item index, written with ``HSETNX``;
- ``P:att:<id>``: how many times each item was claimed.

A claim is a stream delivery (``XREADGROUP``); a delivered entry stays in the group's pending
list until its result is stored. A worker renews its claims by resetting their idle time
(``XCLAIM ... JUSTID``); entries idle for longer than the lease belong to a dead worker and
are taken over by the next claim (``XAUTOCLAIM``). Storing a result, acknowledging and
deleting the entry, and finishing the job happen in one Lua script, so they are atomic.
Finished jobs expire by Redis TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from foundation.redis_client import RedisClient, hash_tag, open_redis
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisQueue:
    """A `BatchQueue` on Redis Streams; build it with :meth:`open`."""

    group = "workers"

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = "semcache:batch",
        lease_s: float = 30.0,
        results_ttl_s: float = 86400.0,
        max_age_s: float = 7 * 86400.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.prefix = prefix = hash_tag(prefix)
        self.stream = f"{prefix}:items"
        self.lease_s = lease_s
        self.results_ttl_s = results_ttl_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._complete = client.register_script(_COMPLETE)
        self._requeue = client.register_script(_REQUEUE)

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> RedisQueue:
        client = open_redis(url)
        queue = cls(client, **kwargs)
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
        # Finished entries are deleted from the stream: what is left is waiting or leased.
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
            await pipe.execute()

    async def claim(self, consumer: str, limit: int, wait_s: float) -> list[WorkItem]:
        if limit <= 0:
            return []
        # Entries idle past the lease belong to a dead (or stuck) worker: take them over first.
        reclaimed = await self.client.xautoclaim(
            self.stream,
            self.group,
            consumer,
            min_idle_time=self._ms(self.lease_s),
            start_id="0-0",
            count=limit,
        )
        entries: list[tuple[Any, Any]] = [e for e in reclaimed[1] if e and e[1]]
        if not entries:
            # A blocking read: an idle worker costs nothing and wakes on the next XADD. It
            # returns at the latest after one lease, to take over the entries of dead workers.
            block = self._ms(min(wait_s, self.lease_s)) if wait_s > 0 else None
            read: Any = await self.client.xreadgroup(
                self.group, consumer, {self.stream: ">"}, count=limit, block=block
            )
            for _stream, delivered in read or []:
                entries.extend(e for e in delivered if e and e[1])
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
            return  # left pending: the next claim after the lease takes it over
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
        await self.client.aclose()
