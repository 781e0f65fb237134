"""Epoch-based purge: a purge bumps a counter; every tier and every gateway stop serving at once.

Epoch fields: ``global``, ``model:<id>``, ``scope:<scope>`` (a tenant or ``shared``),
``tag:<tag>`` and ``key:<short id>``. The first three are part of every key's digest (a
purge changes the keys, so old entries are simply never found again, in any tier); tag and
key epochs are recorded in each entry when it is filled and compared on read.

Where the epochs live:

* :class:`LocalEpochs` — one machine. A JSON file next to the disk tier keeps them over a
  restart; a memory-mapped 8-byte generation counter beside it tells every worker process of
  a bump at the cost of reading one integer per lookup.
* :class:`RedisEpochs` — several gateways. A Redis hash holds the epochs, a counter its
  generation; every lookup compares the generation (one small GET, or less often with
  ``epoch_recheck_s``) and a pub/sub message pushes each bump to every gateway. The local
  book mirrors the hash, so a gateway that loses Redis keeps the last epochs it saw and
  applies its own purges locally; they are re-sent when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import orjson

from foundation.redis_client import RedisClient, open_redis, ready_for_pubsub
from semcache.cache_keys import scope_for
from semcache.change_counter import Generation
from semcache.tiers.base import Store
from semcache.tiers.redis import OUTAGE_ERRORS, RedisLink

log = logging.getLogger(__name__)

GLOBAL: Final = "global"


def model_field(model_id: str) -> str:
    return f"model:{model_id}"


def scope_field(scope: str) -> str:
    return f"scope:{scope}"


def tag_field(tag: str) -> str:
    return f"tag:{tag}"


def key_field(short_id: str) -> str:
    return f"key:{short_id[:12]}"


class Epochs(msgspec.Struct, frozen=True):
    """An immutable snapshot of the purge epochs."""

    values: dict[str, int] = msgspec.field(default_factory=dict)

    def get(self, field: str) -> int:
        return self.values.get(field, 0)

    def for_key(self, model_id: str, scope: str) -> tuple[int, int, int]:
        """The epochs that go into a key's digest: (global, model, scope)."""
        v = self.values
        return (v.get(GLOBAL, 0), v.get(f"model:{model_id}", 0), v.get(f"scope:{scope}", 0))

    def recorded(self, short_id: str, tags: Iterable[str]) -> dict[str, int]:
        """Non-zero epochs of an entry's key and tags, to store in the entry."""
        out: dict[str, int] = {}
        for f in (key_field(short_id), *(tag_field(t) for t in tags)):
            n = self.values.get(f, 0)
            if n:
                out[f] = n
        return out

    def purged(self, short_id: str, tags: Iterable[str], recorded: Mapping[str, int]) -> bool:
        """Whether an entry filled with ``recorded`` epochs was purged since (by key or tag)."""
        v = self.values
        if not v:
            return False
        for f in (key_field(short_id), *(tag_field(t) for t in tags)):
            if v.get(f, 0) > recorded.get(f, 0):
                return True
        return False


class EpochBook(ABC):
    """Where the current epochs come from and where purges write them."""

    @abstractmethod
    async def snapshot(self) -> Epochs:
        """The current epochs; cheap enough to call on every lookup."""

    @abstractmethod
    async def bump(self, fields: Sequence[str]) -> bool:
        """Increment ``fields``; True when every sharer (other workers, other gateways) sees it."""

    async def start(self) -> None:  # noqa: B027  (optional hook)
        """Begin background work (pub/sub listener)."""

    async def aclose(self) -> None:  # noqa: B027  (optional hook)
        """Stop background work."""


# --------------------------------------------------------------------------- one machine


class LocalEpochs(EpochBook):
    """Epochs in memory, optionally persisted in ``directory`` and shared by its processes."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self._values: dict[str, int] = {}
        self._snap = Epochs()
        self._dir = Path(directory) if directory is not None else None
        self._generation: Generation | None = None
        self._seen_gen = -1
        if self._dir is not None:
            self._generation = Generation(self._dir / "epochs.gen", self._dir / "epochs.lock")
            self._reload()

    # -- files (blocking, small; called inline only where noted)

    @property
    def _json(self) -> Path:
        assert self._dir is not None
        return self._dir / "epochs.json"

    def _gen(self) -> int:
        assert self._generation is not None
        return self._generation.read()

    def _reload(self) -> None:
        gen = self._gen()
        try:
            data = orjson.loads(self._json.read_bytes())
        except FileNotFoundError:
            data = {}
        except (OSError, orjson.JSONDecodeError) as exc:
            log.error("cannot read %s: %s; keeping the epochs in memory", self._json, exc)
            data = {}
        if isinstance(data, dict):
            for k, v in data.items():
                if isinstance(v, int) and v > self._values.get(k, 0):
                    self._values[k] = v
        self._snap = Epochs(dict(self._values))
        self._seen_gen = gen

    def _write(self) -> None:
        tmp = self._json.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(orjson.dumps(self._values, option=orjson.OPT_SORT_KEYS))
        os.replace(tmp, self._json)
        assert self._generation is not None
        self._generation.increment()

    def _apply(self, update: Mapping[str, int] | None, bump: Sequence[str]) -> None:
        """Read-modify-write under the directory lock (blocking)."""
        if self._dir is None:
            self._merge_values(update or {}, bump)
            return
        assert self._generation is not None
        with self._generation.locked():
            self._reload()
            if self._merge_values(update or {}, bump):
                self._write()
                self._seen_gen = self._gen()

    def _merge_values(self, update: Mapping[str, int], bump: Sequence[str]) -> bool:
        changed = False
        for f in bump:
            self._values[f] = self._values.get(f, 0) + 1
            changed = True
        for f, n in update.items():
            if n > self._values.get(f, 0):
                self._values[f] = n
                changed = True
        if changed:
            self._snap = Epochs(dict(self._values))
        return changed

    # -- EpochBook

    async def snapshot(self) -> Epochs:
        # Reading 8 bytes of shared memory: no syscall, so it is fine on the event loop.
        if self._generation is not None and self._gen() != self._seen_gen:
            await asyncio.to_thread(self._reload)
        return self._snap

    def current(self) -> Epochs:
        """The last snapshot, without checking other processes."""
        return self._snap

    async def bump(self, fields: Sequence[str]) -> bool:
        await asyncio.to_thread(self._apply, None, list(fields))
        return True

    async def merge(self, values: Mapping[str, int]) -> None:
        """Raise local epochs to ``values`` where those are higher (from Redis)."""
        if any(n > self._values.get(f, 0) for f, n in values.items()):
            await asyncio.to_thread(self._apply, dict(values), ())

    async def aclose(self) -> None:
        if self._generation is not None:
            self._generation.close()
            self._generation = None


# --------------------------------------------------------------------------- several gateways


# Sets each given hash field to max(current, given) and bumps the generation counter.
_RAISE_LUA: Final = """
for i = 1, #ARGV, 2 do
  local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  local v = tonumber(ARGV[i + 1])
  if v > cur then redis.call('HSET', KEYS[1], ARGV[i], v) end
end
return redis.call('INCR', KEYS[2])
"""


class RedisEpochs(EpochBook):
    """Epochs in Redis, mirrored in a :class:`LocalEpochs`, pushed to every gateway by pub/sub."""

    def __init__(
        self,
        link: RedisLink,
        local: LocalEpochs | None = None,
        *,
        recheck_s: float = 0.0,
        clock: Any = time.monotonic,
    ) -> None:
        self.link = link
        self.local = local or LocalEpochs()
        self.recheck_s = recheck_s
        self.clock = clock
        self._hash = link.key("{epochs}")
        self._gen_key = link.key("{epochs}:gen")
        self.channel = link.key("epochs:bump")
        self._remote_gen: int | None = None
        self._checked_at = -1e18
        self._pending: set[str] = set()
        self._listener: asyncio.Task[None] | None = None
        self._pubsub_client: RedisClient | None = None
        self.messages = 0

    async def _refresh(self, *, force: bool = False) -> None:
        """Bring the local mirror up to date with Redis (cheap when nothing changed)."""
        raw: Any = await self.link.call(lambda r: r.get(self._gen_key), b"")
        if raw == b"" or not self.link.available:
            return  # Redis unavailable: keep the local epochs
        gen = int(raw or 0)
        if not force and not self._pending and gen == self._remote_gen:
            return
        values: Any = await self.link.call(lambda r: r.hgetall(self._hash), None)
        if values is None:
            return
        remote = {_text(k): int(v) for k, v in values.items()}
        await self.local.merge(remote)
        # Redis lost epochs we know (restart without persistence, flush): raise them again,
        # or a later purge would count up from a lower base and not change anything here.
        behind = {f: n for f, n in self.local.current().values.items() if n > remote.get(f, 0)}
        if behind:
            await self._raise_remote(behind)
            gen = -1
        if self._pending:
            await self._push_pending()
            gen = -1  # our own bumps changed the hash: read it again next time
        self._remote_gen = gen

    async def _raise_remote(self, values: Mapping[str, int]) -> None:
        args: list[str | int] = []
        for f, n in values.items():
            args += [f, n]

        async def op(r: RedisClient) -> None:
            await r.eval(_RAISE_LUA, 2, self._hash, self._gen_key, *args)
            await r.publish(self.channel, orjson.dumps(dict(values)))

        await self.link.call(op, None)
        log.warning("raised %d purge epoch(s) that Redis had lost", len(values))

    async def _push_pending(self) -> None:
        fields = sorted(self._pending)
        done = await self._bump_remote(fields)
        if done:
            self._pending.difference_update(fields)
            log.warning("re-sent %d purge(s) made while Redis was unavailable", len(fields))

    async def snapshot(self) -> Epochs:
        local = await self.local.snapshot()
        now = self.clock()
        if now - self._checked_at >= self.recheck_s:
            self._checked_at = now
            await self._refresh()
            return self.local.current()
        return local

    async def _bump_remote(self, fields: Sequence[str]) -> bool:
        async def op(r: RedisClient) -> dict[str, int]:
            async with r.pipeline(transaction=True) as p:
                for f in fields:
                    p.hincrby(self._hash, f, 1)
                p.incr(self._gen_key)
                res = await p.execute()
            out = {f: int(n) for f, n in zip(fields, res[:-1], strict=True)}
            await r.publish(self.channel, orjson.dumps(out))
            self._remote_gen = None  # force a full read next time (other bumps may interleave)
            return out

        values = await self.link.call(op, None)
        if values is None:
            return False
        await self.local.merge(values)
        return True

    async def bump(self, fields: Sequence[str]) -> bool:
        await self._refresh(force=True)  # count up from the highest epochs anyone has seen
        if await self._bump_remote(fields):
            return True
        await self.local.bump(fields)
        self._pending.update(fields)
        log.warning("Redis unavailable: purge of %s applied locally, re-sent later", list(fields))
        return False

    # -- pub/sub

    async def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="semcache-epochs-pubsub")

    async def _listen(self) -> None:
        delay = self.link.breaker.base_s
        while True:
            client = open_redis(
                self.link.url,
                socket_connect_timeout=self.link.timeout_s,
                socket_timeout=None,
                decode_responses=False,
            )
            self._pubsub_client = client
            try:
                await ready_for_pubsub(client)
                async with client.pubsub() as ps:
                    await ps.subscribe(self.channel)
                    self._checked_at = -1e18  # we may have missed bumps: recheck on next read
                    delay = self.link.breaker.base_s
                    while True:
                        msg = await ps.get_message(ignore_subscribe_messages=True, timeout=5.0)
                        if msg is None:
                            await ps.ping()
                            continue
                        self._on_message(msg.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("epoch pub/sub lost (%s); retrying in %.2fs", exc, delay)
            finally:
                with contextlib.suppress(*OUTAGE_ERRORS):
                    await client.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.link.breaker.max_s)

    def _on_message(self, data: Any) -> None:
        try:
            values = orjson.loads(data)
        except (orjson.JSONDecodeError, TypeError):
            return
        if isinstance(values, dict):
            self.messages += 1
            self._checked_at = -1e18
            clean = {str(k): int(v) for k, v in values.items() if isinstance(v, int)}
            task = asyncio.get_running_loop().create_task(self.local.merge(clean))
            task.add_done_callback(_log_failure)

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        await self.local.aclose()


def _text(k: bytes | str) -> str:
    return k.decode() if isinstance(k, bytes) else k


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("epoch merge failed: %s", task.exception())


# --------------------------------------------------------------------------- purge API


class PurgeResult(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    """``key``, ``model``, ``tenant``, ``scope``, ``tag`` or ``all``."""
    target: str
    propagated: bool
    """False when Redis was down: applied here and re-sent to the others once it is back."""


class Purger:
    """Purge by key, model, tenant, tag or everything, by bumping epochs."""

    def __init__(self, book: EpochBook, stores: Sequence[Store[Any]] = ()) -> None:
        self.book = book
        self.stores = list(stores)

    async def purge_key(self, key: str) -> PurgeResult:
        """Purge one entry by its digest (or its 12-character short id)."""
        key = key.strip().lower()
        if len(key) < 12 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError("a key is the hex digest or its first 12 characters")
        ok = await self.book.bump([key_field(key)])
        if len(key) == 64:
            for s in self.stores:
                await s.delete(key)
        return PurgeResult(kind="key", target=key, propagated=ok)

    async def purge_model(self, model_id: str) -> PurgeResult:
        ok = await self.book.bump([model_field(model_id)])
        return PurgeResult(kind="model", target=model_id, propagated=ok)

    async def purge_tenant(self, tenant: str) -> PurgeResult:
        """Purge a tenant's own answers (answers of shared models are not the tenant's)."""
        ok = await self.book.bump([scope_field(scope_for(tenant, shared=False))])
        return PurgeResult(kind="tenant", target=tenant, propagated=ok)

    async def purge_scope(self, scope: str) -> PurgeResult:
        """Purge a raw key scope (``shared`` for every shared answer)."""
        ok = await self.book.bump([scope_field(scope)])
        return PurgeResult(kind="scope", target=scope, propagated=ok)

    async def purge_tag(self, tag: str) -> PurgeResult:
        ok = await self.book.bump([tag_field(tag)])
        return PurgeResult(kind="tag", target=tag, propagated=ok)

    async def purge_all(self) -> PurgeResult:
        """Bump the global epoch, then free the space of every tier this gateway can reach."""
        ok = await self.book.bump([GLOBAL])
        for s in self.stores:
            await s.clear()
        return PurgeResult(kind="all", target="*", propagated=ok)
