"""Records in Redis shared by several gateways (files, batches): key names and the paging of
a tenant's sorted index.

Every key of one tenant carries the tenant's hash as a Redis Cluster hash tag
(``<prefix>:{<tenant hash>}:...``), so a record and its tenant's index live on one shard and
change together in one transaction or script.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from foundation.redis_client import RedisClient
from server.openai.records import tenant_key

T = TypeVar("T")

CHUNK = 100
"""Index entries read per round trip while a page is filled."""


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def raw(value: Any) -> bytes | None:
    """A value of a client that answers bytes (``decode_responses`` off), typed as such."""
    return value if isinstance(value, bytes) else None


def tenant_tag(prefix: str, tenant: str) -> str:
    """The prefix of the tenant's keys, its hash a Redis Cluster hash tag."""
    return f"{prefix}:{{{tenant_key(tenant)}}}"


def ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


async def page(
    client: RedisClient,
    index: str,
    load: Callable[[list[str]], Awaitable[list[T | None]]],
    *,
    after: str | None,
    limit: int,
    descending: bool = True,
    keep: Callable[[T], bool] = lambda _: True,
) -> tuple[list[T], bool]:
    """One page of the records an index (a sorted set of ids, scored by creation time) names,
    after the id ``after``, and whether more follow. ``load`` reads records by id, None for
    one that expired or was removed: its id is dropped from the index on the way."""
    start = 0
    if after is not None:
        rank = await (client.zrevrank if descending else client.zrank)(index, after)
        if rank is None:
            return [], False
        start = cast(int, rank) + 1
    out: list[T] = []
    while len(out) <= limit:
        ids = [
            text(m) for m in await client.zrange(index, start, start + CHUNK - 1, desc=descending)
        ]
        if not ids:
            break
        loaded = await load(ids)
        dead = [i for i, record in zip(ids, loaded, strict=True) if record is None]
        if dead:
            await client.zrem(index, *dead)
        start += len(ids) - len(dead)  # the dead ones no longer take a rank
        out.extend(r for r in loaded if r is not None and keep(r))
    return out[:limit], len(out) > limit
