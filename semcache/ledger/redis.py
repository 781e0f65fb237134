"""Ledger storage in Redis counters, so that N gateways on one Redis sum into one ledger.

Keys (``P`` is the policy's Redis prefix)::

    P:usage:day:<day>                 set of the rows of a day: JSON ["tenant", "model", "route"]
    P:usage:row:<day>:<row>           hash of the row's sums (HINCRBY / HINCRBYFLOAT)
    P:usage:tenant:<day>:<tenant>     hash: tokens, usd, tokens_saved (for budgets)
    P:usage:tenant:<month>:<tenant>   the same for the month
    P:usage:batch:<id>                marks an applied batch for a day

Every flush is one pipeline of one script call per batch. The script applies a batch only if
its marker is absent and sets it, atomically: a batch whose answer was lost (a timeout after
Redis applied it) is sent again as it was and applied once. Usage keys never expire.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from typing import Final

import orjson
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from foundation.redis_client import RedisClient, hash_tag, open_redis
from foundation.redis_replication import replica_ack
from semcache.ledger.base import Batch, LedgerUnavailable, Row, Storage
from semcache.ledger.records import INT_FIELDS, SUM_FIELDS, spend_values
from semcache.tiers.redis import OUTAGE_ERRORS

MARKER_TTL_S: Final = 86_400

# KEYS: the batch marker, then per row: row hash, day set, tenant-day hash, tenant-month hash.
# ARGV: the marker's TTL, then per row: the row's set member, its sums in SUM_FIELDS order,
# then tokens, usd, tokens_saved for the tenant hashes.
_APPLY = f"""
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
local fields = {{{", ".join(f"'{f}'" for f in SUM_FIELDS)}}}
local totals = {{'tokens', 'usd', 'tokens_saved'}}
local a = 2
for k = 2, #KEYS, 4 do
    redis.call('SADD', KEYS[k + 1], ARGV[a])
    a = a + 1
    for i, f in ipairs(fields) do
        if tonumber(ARGV[a]) ~= 0 then
            if i <= {len(INT_FIELDS)} then
                redis.call('HINCRBY', KEYS[k], f, ARGV[a])
            else
                redis.call('HINCRBYFLOAT', KEYS[k], f, ARGV[a])
            end
        end
        a = a + 1
    end
    for i, f in ipairs(totals) do
        if tonumber(ARGV[a]) ~= 0 then
            for _, h in ipairs({{KEYS[k + 2], KEYS[k + 3]}}) do
                if i == 2 then
                    redis.call('HINCRBYFLOAT', h, f, ARGV[a])
                else
                    redis.call('HINCRBY', h, f, ARGV[a])
                end
            end
        end
        a = a + 1
    end
end
return 1
"""


def _num(v: float, integer: bool) -> str:
    return str(int(v)) if integer else repr(float(v))


def _days(start: str, end: str) -> list[str]:
    first, last = dt.date.fromisoformat(start), dt.date.fromisoformat(end)
    return [(first + dt.timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


class RedisStorage(Storage):
    """Usage counters on the Redis at ``url``, under ``<prefix>:usage:``."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "semcache",
        timeout_s: float = 1.0,
        replicas: int = 0,
        replica_timeout_s: float = 1.0,
    ) -> None:
        self.url = url
        self.name = f"redis {url}"
        self.base = hash_tag(f"{prefix}:usage")
        self.timeout_s = timeout_s
        self.client: RedisClient = open_redis(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
        )
        self.ack = replica_ack(self.client, url, replicas=replicas, timeout_s=replica_timeout_s)
        """Confirms each flush on replicas; one not confirmed is kept and sent again."""

    async def open(self) -> None:
        """Nothing to open: the client connects on its first command (Redis may be down)."""

    async def close(self) -> None:
        try:
            if self.ack is not None:
                await self.ack.aclose()
            await self.client.aclose()
        except OUTAGE_ERRORS:
            pass

    def _row_key(self, day: str, member: str) -> str:
        return f"{self.base}:row:{day}:{member}"

    def _tenant_key(self, period_key: str, tenant: str) -> str:
        return f"{self.base}:tenant:{period_key}:{tenant}"

    def _script_args(self, batch: Batch) -> tuple[list[str], list[str]]:
        keys = [f"{self.base}:batch:{batch.id}"]
        args = [str(MARKER_TTL_S)]
        n_int = len(INT_FIELDS)
        for (day, tenant, model, route), values in batch.counts.rows.items():
            member = orjson.dumps([tenant, model, route]).decode()
            keys += [
                self._row_key(day, member),
                f"{self.base}:day:{day}",
                self._tenant_key(day, tenant),
                self._tenant_key(day[:7], tenant),
            ]
            args.append(member)
            args += [_num(v, i < n_int) for i, v in enumerate(values)]
            tokens, usd, saved = spend_values(values)
            args += [_num(tokens, True), _num(usd, False), _num(saved, True)]
        return keys, args

    async def write(self, batches: Sequence[Batch]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for b in batches:
            keys, args = self._script_args(b)
            pipe.eval(_APPLY, len(keys), *keys, *args)
        async with asyncio.timeout(self.timeout_s * 4):
            await self.client.ping()  # down: the batches were not sent, they may merge
            for b in batches:  # from here on Redis may apply them without our knowing
                b.attempted = True
            await pipe.execute()
        if self.ack is not None:  # every key of the ledger shares its base's slot
            await self.ack.confirm(self.base)

    async def read(
        self, start: str, end: str, group_by: Sequence[str], tenant: str | None
    ) -> list[Row]:
        days = _days(start, end)
        try:
            async with asyncio.timeout(self.timeout_s * 4 + len(days) * 0.01):
                pipe = self.client.pipeline(transaction=False)
                for day in days:
                    pipe.smembers(f"{self.base}:day:{day}")
                members = await pipe.execute()
                wanted: list[tuple[str, str, str, str]] = []
                for day, found in zip(days, members, strict=True):
                    for raw in sorted(found):
                        t, model, route = orjson.loads(raw)
                        if tenant is None or t == tenant:
                            wanted.append((day, t, model, route))
                pipe = self.client.pipeline(transaction=False)
                for day, t, model, route in wanted:
                    pipe.hgetall(self._row_key(day, orjson.dumps([t, model, route]).decode()))
                hashes = await pipe.execute() if wanted else []
        except OUTAGE_ERRORS as exc:
            raise LedgerUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        rows: list[Row] = []
        n_int = len(INT_FIELDS)
        for (day, t, model, route), h in zip(wanted, hashes, strict=True):
            values = [
                (int if i < n_int else float)(h.get(f.encode(), 0))
                for i, f in enumerate(SUM_FIELDS)
            ]
            rows.append(({"day": day, "tenant": t, "model": model, "route": route}, values))
        return rows

    async def read_spend(self, tenant: str, period_key: str) -> tuple[int, float, int]:
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                tokens, usd, saved = await self.client.hmget(
                    self._tenant_key(period_key, tenant), ["tokens", "usd", "tokens_saved"]
                )
        except OUTAGE_ERRORS as exc:
            raise LedgerUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        return int(tokens or 0), float(usd or 0.0), int(saved or 0)
