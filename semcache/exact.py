"""The exact-match cache over the tiers: lookup, fill, coalescing, stale-while-revalidate.

Typical use by the server (which maps headers to :class:`CacheControl`)::

    req = await cache.prepare(route="chat", body=body, model_id=m, revision=rev,
                              rule=policy.rule(m, "chat"), tenant=tenant, control=control)
    result = await cache.get_or_fill(req, fill)     # fill: async () -> CachedAnswer | None
    # result.status: HIT / STALE / MISS / EXPIRED / BYPASS, result.entry, result.age

A caller that must fetch the answer in its own task (a stream relayed as it arrives) uses
``claim`` instead: it returns the result, or a :class:`Flight` to lead and then ``finish``.

Lookup walks L1 (memory) → L2 (disk) → L3 (Redis) and copies a lower-tier hit into the tiers
above it. L1 holds verified, decoded entries; entries read from a byte tier are checked
against their checksum, and a failing one is deleted, counted and treated as absent.

Coalescing: concurrent misses of one key make one ``fill`` call (the *leader*); the others
wait for its answer. When the leader's ``fill`` raises, every waiter gets the same exception
(one backend error is not retried fifty times). When it returns ``None`` (an incomplete answer,
e.g. the stream was cut) or the leader is cancelled (its client went away), the waiters start
over: one of them becomes the new leader and calls its own ``fill``.

stale-while-revalidate (RFC 5861): within ``swr_s`` after expiry a lookup returns STALE at
once and one background refresh runs (never two for one key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from semcache.entry import CachedAnswer, IntegrityError, decode_entry, encode_entry
from semcache.keys import CacheKey, build_key, is_deterministic, scope_for
from semcache.metrics import CacheMetrics
from semcache.policy import CacheRule, Prices, TierSettings
from semcache.purge import EpochBook, Epochs, LocalEpochs, Purger, PurgeResult, RedisEpochs
from semcache.tiers import DiskStore, MemoryStore, RedisLink, RedisStore, Store

log = logging.getLogger(__name__)

Fill = Callable[[], Awaitable[CachedAnswer | None]]


class CacheStatus(StrEnum):
    """Values of ``Cache-Status`` / ``cf-aig-cache-status``."""

    HIT = "HIT"
    MISS = "MISS"
    STALE = "STALE"
    EXPIRED = "EXPIRED"
    BYPASS = "BYPASS"


class CacheControl(msgspec.Struct, frozen=True, kw_only=True):
    """What one request asks of the cache (the server maps headers to this)."""

    bypass_read: bool = False
    """Do not serve from the cache (``no-cache``, ``cf-aig-skip-cache``); still stores."""
    no_store: bool = False
    """Do not store this answer (``no-store``, ``cf-aig-skip-cache``)."""
    ttl_s: int | None = None
    """TTL for the answer this request stores (``cf-aig-cache-ttl``, ``max-age``); capped
    at the rule's ``max_ttl_s``."""
    max_age_s: int | None = None
    """Serve only answers at most this old, and no stale ones (request ``max-age``)."""


class CacheRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the cache needs about one request; built by :meth:`ExactCache.prepare`."""

    key: CacheKey
    route: str
    rule: CacheRule
    control: CacheControl = CacheControl()
    epochs: Epochs = Epochs()
    tags: tuple[str, ...] = ()
    cacheable: bool = True
    """The policy allows caching this request (rule cacheable, determinism satisfied)."""
    write_through: bool = False
    """Store the answer in every tier before the fill returns (a durable semantic record
    will point to it), even when the disk tier writes behind."""


class CacheResult(msgspec.Struct, kw_only=True):
    status: CacheStatus
    key: CacheKey
    entry: CachedAnswer | None = None
    """The answer to send (from the cache, or the one ``fill`` produced)."""
    age_s: float = 0.0
    tier: str | None = None
    """The tier that served a HIT/STALE answer."""
    coalesced: bool = False
    """The answer came from another request's fill."""
    stored: bool = False
    """This call stored the answer."""

    @property
    def age(self) -> int:
        """Whole seconds, for the ``Age`` header."""
        return int(self.age_s)

    @property
    def from_cache(self) -> bool:
        return self.status in (CacheStatus.HIT, CacheStatus.STALE)


class _LeaderGone(Exception):
    """The leader produced no storable answer or was cancelled: waiters start over."""


class _Found(msgspec.Struct):
    entry: CachedAnswer
    index: int
    status: CacheStatus
    age_s: float
    blob: bytes | None


class Flight:
    """A miss one request leads: it fetches the answer, then ends the flight exactly once.

    Concurrent requests for the same key wait for the answer :meth:`finish` hands them, or
    get the exception :meth:`fail` hands them (a cancelled or incomplete leader makes them
    start over). A flight without a future (a policy-bypassed request) is joined by nobody
    and stores nothing.
    """

    __slots__ = ("_cache", "_fut", "_over", "req", "result")

    def __init__(
        self,
        cache: ExactCache,
        req: CacheRequest,
        result: CacheResult,
        fut: asyncio.Future[CachedAnswer] | None,
    ) -> None:
        self._cache = cache
        self.req = req
        self.result = result
        """The lookup's result (MISS / EXPIRED / BYPASS); :meth:`finish` completes it."""
        self._fut = fut
        self._over = False

    def _end(self) -> asyncio.Future[CachedAnswer] | None:
        if self._over:
            raise RuntimeError("this flight has already ended")
        self._over = True
        return self._fut

    async def finish(self, answer: CachedAnswer | None) -> CacheResult:
        """Hand ``answer`` to the waiters and store it (when policy allows: status 200 only).

        ``None`` (an incomplete answer) stores nothing and makes the waiters start over.
        """
        fut = self._end()
        res = self.result
        res.entry = answer
        if fut is None:
            return res
        if answer is None:
            self._abort(fut, _LeaderGone())
            return res
        fut.set_result(answer)
        try:
            # still in flight while storing: a request arriving now joins, not misses
            stored = await self._cache.put(self.req, answer, write_through=self.req.write_through)
            if stored is not None:  # the entry as later hits see it (stamped, sealed)
                res.entry, res.stored = stored, True
        finally:
            self._cache._land(self.req, fut)
        return res

    def fail(self, exc: BaseException) -> None:
        """The fetch raised ``exc``: the waiters get it too, or start over when it is a
        cancellation (the leader's client went away)."""
        fut = self._end()
        if fut is not None:
            self._abort(fut, _LeaderGone() if isinstance(exc, asyncio.CancelledError) else exc)

    def _abort(self, fut: asyncio.Future[CachedAnswer], exc: BaseException) -> None:
        fut.set_exception(exc)
        fut.exception()  # mark retrieved: waiters may be none
        self._cache._land(self.req, fut)

    async def run(self, fill: Fill) -> CacheResult:
        """Lead with ``fill``: call it, then finish with its answer (or fail with its error)."""
        try:
            answer = await fill()
        except BaseException as exc:
            self.fail(exc)
            raise
        return await self.finish(answer)


class ExactCache:
    """Exact-match cache over an optional memory tier and byte tiers (disk, Redis)."""

    def __init__(
        self,
        *,
        memory: MemoryStore[CachedAnswer] | None = None,
        lower: Sequence[Store[bytes]] = (),
        epochs: EpochBook | None = None,
        metrics: CacheMetrics | None = None,
        clock: Callable[[], float] = time.time,
        links: Sequence[RedisLink] = (),
        write_behind: bool = False,
    ) -> None:
        """``write_behind``: writes to the local disk tier run in the background, off the
        request path (the memory tier already holds the answer; Redis stays written through so
        other gateways can read an answer as soon as it was sent)."""
        self.memory = memory
        self.lower = list(lower)
        self.epochs: EpochBook = epochs or LocalEpochs()
        self.metrics = metrics
        self.clock = clock
        self._links = list(links)
        stores: list[Store[Any]] = [*([memory] if memory is not None else []), *self.lower]
        self.purger = Purger(self.epochs, stores)
        self._flights: dict[str, asyncio.Future[CachedAnswer]] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._write_behind = write_behind
        self._closed = False
        self._failing: set[tuple[str, str]] = set()
        """(tier, operation) pairs failing now: logged once, until they work again."""
        for store in self.lower:
            if isinstance(store, DiskStore):
                store.report_writes(partial(self._disk_wrote, store))

    @property
    def tier_names(self) -> list[str]:
        return [*(["memory"] if self.memory is not None else []), *(s.tier for s in self.lower)]

    # ------------------------------------------------------------------ requests

    async def prepare(
        self,
        *,
        route: str,
        body: Mapping[str, Any],
        model_id: str,
        revision: str,
        rule: CacheRule,
        tenant: str | None = None,
        control: CacheControl | None = None,
        tags: Sequence[str] = (),
        chat_template_fp: str = "",
        custom_key: str | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> CacheRequest:
        """Build the versioned, scoped key of a request and decide whether it may be cached.

        ``custom_key`` (``cf-aig-cache-key``) replaces the body's params in the key, within the
        same scope, model, revision and template. Non-deterministic requests are not cached
        when the rule says ``deterministic_only``.
        """
        epochs = await self.epochs.snapshot()
        scope = scope_for(tenant, shared=rule.shared)
        key = build_key(
            route=route,
            body=body,
            scope=scope,
            model_id=model_id,
            revision=revision,
            chat_template_fp=chat_template_fp,
            epochs=epochs.for_key(model_id, scope),
            custom_key=custom_key,
            sampling_defaults=sampling_defaults,
        )
        deterministic = is_deterministic(route, body, sampling_defaults=sampling_defaults)
        cacheable = rule.cacheable and (deterministic or not rule.deterministic_only)
        return CacheRequest(
            key=key,
            route=route,
            rule=rule,
            control=control or CacheControl(),
            epochs=epochs,
            tags=tuple(tags),
            cacheable=cacheable,
        )

    # ------------------------------------------------------------------ lookup

    def _judge(
        self, entry: CachedAnswer, ctl: CacheControl, now: float
    ) -> tuple[CacheStatus, float]:
        age = max(0.0, now - entry.created_at)
        fresh_for = float(entry.ttl_s)
        if ctl.max_age_s is not None:
            fresh_for = min(fresh_for, float(ctl.max_age_s))
            if age < fresh_for:
                return CacheStatus.HIT, age
            return CacheStatus.EXPIRED, age
        if age < fresh_for:
            return CacheStatus.HIT, age
        if age < entry.ttl_s + entry.swr_s:
            return CacheStatus.STALE, age
        return CacheStatus.EXPIRED, age

    async def _read_tier(
        self, i: int, req: CacheRequest
    ) -> tuple[CachedAnswer | None, bytes | None]:
        return await self._read_digest(i, req.key.digest)

    async def _read_digest(self, i: int, digest: str) -> tuple[CachedAnswer | None, bytes | None]:
        if self.memory is not None and i == 0:
            return await self.memory.get(digest), None
        store = self.lower[i - (1 if self.memory is not None else 0)]
        try:
            blob = await store.get(digest)
        except Exception as exc:  # a broken tier is a miss, never a failed request
            self._tier_error(store, "get", exc)
            return None, None
        self._tier_ok(store, "get")
        if blob is None:
            return None, None
        try:
            return decode_entry(blob, digest), blob
        except IntegrityError as exc:
            log.warning("dropping corrupt cache entry %s in %s: %s", digest[:12], store.tier, exc)
            if self.metrics:
                self.metrics.integrity_failures.labels(store.tier).inc()
            await self._delete(store, digest)
            return None, None

    def _store_at(self, i: int) -> Store[Any]:
        if self.memory is not None:
            return self.memory if i == 0 else self.lower[i - 1]
        return self.lower[i]

    def _tier_error(self, store: Store[Any], op: str, exc: Exception, count: int = 1) -> None:
        """Count a failed tier operation (``count`` entries); log the first of a run only."""
        if (store.tier, op) not in self._failing:
            self._failing.add((store.tier, op))
            log.warning(
                "cache tier %s failed on %s: %s: %s; serving without it (every failure is "
                "counted in semcache_exact_tier_errors_total; logged again once it recovers)",
                store.tier,
                op,
                type(exc).__name__,
                exc,
            )
        if self.metrics:
            self.metrics.tier_errors.labels(store.tier, op).inc(count)

    def _tier_ok(self, store: Store[Any], op: str) -> None:
        if self._failing and (store.tier, op) in self._failing:
            self._failing.discard((store.tier, op))
            log.warning("cache tier %s works again on %s", store.tier, op)

    def _disk_wrote(self, store: DiskStore, count: int, exc: Exception | None) -> None:
        """A batch of the disk tier was written (``exc`` None) or lost."""
        if exc is None:
            self._tier_ok(store, "set")
        else:
            self._tier_error(store, "set", exc, count)

    async def _set(self, store: Store[bytes], key: str, blob: bytes, ttl_s: float) -> None:
        try:
            await store.set(key, blob, ttl_s)
        except Exception as exc:
            if not isinstance(store, DiskStore):  # the disk tier reports its own batches
                self._tier_error(store, "set", exc)
            return
        self._tier_ok(store, "set")
        if self.metrics:
            self.metrics.bytes_stored.labels(store.tier).inc(len(blob))

    async def _write(
        self, store: Store[bytes], key: str, blob: bytes, ttl_s: float, *, through: bool = False
    ) -> None:
        """Write through, or in the background for the disk tier when writing behind."""
        if through or not self._write_behind or self._closed or not isinstance(store, DiskStore):
            await self._set(store, key, blob, ttl_s)
            return
        # Batched with the writes around it, off the request path (see DiskStore.set_behind).
        store.set_behind(key, blob, ttl_s)
        if self.metrics:
            self.metrics.bytes_stored.labels(store.tier).inc(len(blob))

    async def flush(self) -> None:
        """Commit the background writes started so far."""
        for store in self.lower:
            if isinstance(store, DiskStore):
                try:
                    await store.flush()
                except Exception as exc:
                    self._tier_error(store, "set", exc)

    async def _delete(self, store: Store[Any], key: str) -> None:
        try:
            await store.delete(key)
        except Exception as exc:
            self._tier_error(store, "delete", exc)

    async def _find(self, req: CacheRequest, now: float) -> tuple[_Found | None, bool]:
        """Best servable entry walking down the tiers; also whether an expired one was seen.

        A fresh entry ends the walk. A stale one is kept while the lower tiers are asked for
        a fresh one (another worker or gateway may have refreshed it already).
        """
        expired = False
        stale: _Found | None = None
        n = len(self.lower) + (1 if self.memory is not None else 0)
        for i in range(n):
            entry, blob = await self._read_tier(i, req)
            if entry is None:
                continue
            if req.epochs.purged(req.key.short_id, entry.tags, entry.epochs):
                store = self._store_at(i)
                if self.metrics:
                    self.metrics.purged_reads.labels(store.tier).inc()
                await self._delete(store, req.key.digest)
                continue
            status, age = self._judge(entry, req.control, now)
            if status is CacheStatus.EXPIRED:
                expired = True
                continue
            found = _Found(entry=entry, index=i, status=status, age_s=age, blob=blob)
            if status is CacheStatus.HIT:
                return found, expired
            if stale is None or entry.created_at > stale.entry.created_at:
                stale = found
        return stale, expired

    async def _backfill(self, req: CacheRequest, found: _Found, now: float) -> None:
        entry = found.entry
        remaining = entry.created_at + entry.ttl_s + entry.swr_s - now
        if remaining <= 0:
            return
        blob = found.blob
        for i in range(found.index):
            store = self._store_at(i)
            if store is self.memory:
                await self.memory.set(req.key.digest, entry, remaining)
                continue
            if blob is None:
                blob = encode_entry(entry, req.key.digest)
            await self._write(store, req.key.digest, blob, remaining)

    async def lookup(self, req: CacheRequest) -> CacheResult:
        """Look the request up; counts metrics. Never calls a backend."""
        t0 = time.perf_counter()
        if not req.cacheable or req.control.bypass_read:
            res = CacheResult(status=CacheStatus.BYPASS, key=req.key)
        else:
            res = await self._search(req)
        self.count(req, res, t0)
        return res

    async def fresh_hit(self, req: CacheRequest) -> CacheResult | None:
        """The request's fresh answer (a HIT), counted by nobody yet: the caller serves it
        and then calls :meth:`count`. ``None`` whenever :meth:`lookup` would say anything
        but HIT; nothing is counted then, and a later :meth:`lookup` finds the same."""
        if not req.cacheable or req.control.bypass_read:
            return None
        res = await self._search(req)
        return res if res.status is CacheStatus.HIT else None

    async def _search(self, req: CacheRequest) -> CacheResult:
        now = self.clock()
        found, expired = await self._find(req, now)
        if found is None:
            status = CacheStatus.EXPIRED if expired else CacheStatus.MISS
            return CacheResult(status=status, key=req.key)
        if found.index > 0:
            await self._backfill(req, found, now)
        return CacheResult(
            status=found.status,
            key=req.key,
            entry=found.entry,
            age_s=found.age_s,
            tier=self._store_at(found.index).tier,
        )

    def count(self, req: CacheRequest, res: CacheResult, started: float) -> None:
        """Count a lookup's result (``started``: its ``perf_counter`` at the start)."""
        if not self.metrics:
            return
        model = req.key.model_id
        if res.status is CacheStatus.BYPASS:
            self.metrics.bypasses.labels(model).inc()
        elif res.entry is not None and res.tier is not None:
            self.metrics.served(
                model,
                res.tier,
                res.entry,
                req.rule.prices,
                stale=res.status is CacheStatus.STALE,
            )
        else:
            (
                self.metrics.expired if res.status is CacheStatus.EXPIRED else self.metrics.misses
            ).labels(model).inc()
        self.metrics.lookup_seconds.labels(res.status.value).observe(time.perf_counter() - started)

    async def lookup_digest(self, digest: str) -> CacheResult | None:
        """The entry stored under ``digest`` when it is still servable (not purged, not
        expired), found by its digest alone (a content-addressed read); ``None`` otherwise.

        The entry's own key says which scope, model and revision it answers for: the caller
        checks that the reader may see that scope and that the revision is current.
        """
        epochs = await self.epochs.snapshot()
        now = self.clock()
        n = len(self.lower) + (1 if self.memory is not None else 0)
        for i in range(n):
            entry, _ = await self._read_digest(i, digest)
            key = entry.key if entry is not None else None
            if entry is None or key is None or key.digest != digest:
                continue
            current = epochs.for_key(key.model_id, key.scope) == key.epochs
            if not current or epochs.purged(key.short_id, entry.tags, entry.epochs):
                continue
            status, age = self._judge(entry, CacheControl(), now)
            if status is CacheStatus.EXPIRED:
                continue
            tier = self._store_at(i).tier
            if self.metrics:
                self.metrics.served(
                    key.model_id, tier, entry, Prices(), stale=status is CacheStatus.STALE
                )
            return CacheResult(status=status, key=key, entry=entry, age_s=age, tier=tier)
        return None

    # ------------------------------------------------------------------ store

    def _effective_ttl(self, req: CacheRequest) -> int:
        ttl = req.control.ttl_s if req.control.ttl_s is not None else req.rule.ttl_s
        return max(0, min(ttl, req.rule.max_ttl_s))

    async def store(
        self, req: CacheRequest, answer: CachedAnswer, *, write_through: bool = False
    ) -> bool:
        """Store a complete answer if policy and request allow it; True when stored.

        ``write_through``: return only once every tier holds it, even when the disk tier
        writes behind (an answer a durable semantic record will point to).
        """
        return await self.put(req, answer, write_through=write_through) is not None

    async def put(
        self, req: CacheRequest, answer: CachedAnswer, *, write_through: bool = False
    ) -> CachedAnswer | None:
        """:meth:`store`, returning the entry as stored (``None`` when not stored)."""
        if not req.cacheable or req.control.no_store or answer.status != 200:
            return None
        ttl = self._effective_ttl(req)
        if ttl <= 0:
            return None
        key = req.key
        entry = msgspec.structs.replace(
            answer,
            created_at=self.clock(),
            ttl_s=ttl,
            swr_s=req.rule.swr_s,
            tags=req.tags,
            epochs=req.epochs.recorded(key.short_id, req.tags),
            model_id=answer.model_id or key.model_id,
            key=key,
            route=req.route,
        )
        life = float(ttl + entry.swr_s)
        if self.memory is not None:
            await self.memory.set(key.digest, entry, life)
        if self.lower:
            blob = encode_entry(entry, key.digest)
            writes = [
                self._write(s, key.digest, blob, life, through=write_through) for s in self.lower
            ]
            if len(writes) == 1:
                await writes[0]  # no task for one tier (the disk tier, usually writing behind)
            else:
                await asyncio.gather(*writes)
        if self.metrics:
            self.metrics.stores.labels(key.model_id).inc()
            if self.memory is not None:
                self.metrics.bytes_stored.labels("memory").inc(entry.payload_bytes)
        return entry

    # ------------------------------------------------------------------ fill

    async def _memory_fresh(self, req: CacheRequest) -> CachedAnswer | None:
        """An answer a just-finished leader stored (closes the gap after its flight ended)."""
        if self.memory is None:
            return None
        entry = await self.memory.get(req.key.digest)
        if entry is None or req.epochs.purged(req.key.short_id, entry.tags, entry.epochs):
            return None
        status, _ = self._judge(entry, req.control, self.clock())
        return entry if status is CacheStatus.HIT else None

    async def _join_or_lead(
        self, req: CacheRequest, res: CacheResult, *, reuse_recent: bool = True
    ) -> CacheResult | Flight:
        """After a miss: another request's answer (``res``, coalesced), or a flight this
        request leads, one per key at a time.

        ``reuse_recent``: a request whose lookup missed may take an answer a leader stored
        since (its flight ended between our lookup and now); not for ``bypass_read``.
        """
        digest = req.key.digest
        while True:
            fut = self._flights.get(digest)
            if fut is None:
                recent = await self._memory_fresh(req) if reuse_recent else None
                if recent is not None:
                    res.entry, res.coalesced = recent, True
                    return res
                if digest not in self._flights:
                    break
                continue
            try:
                answer = await asyncio.shield(fut)
            except _LeaderGone:
                continue
            if self.metrics:
                self.metrics.coalesced.labels(req.key.model_id).inc()
            res.entry, res.coalesced = answer, True
            return res
        fut = asyncio.get_running_loop().create_future()
        self._flights[digest] = fut
        return Flight(self, req, res, fut)

    def _land(self, req: CacheRequest, fut: asyncio.Future[CachedAnswer]) -> None:
        if self._flights.get(req.key.digest) is fut:
            del self._flights[req.key.digest]

    async def claim(self, req: CacheRequest, refresh: Fill) -> CacheResult | Flight:
        """Serve from the cache, or hand the caller the :class:`Flight` of a miss to lead.

        Like :meth:`get_or_fill`, except that the leader of a miss fetches the answer itself,
        in its own task (a stream's response relays what it fetches), and ends the flight
        with :meth:`Flight.finish` or :meth:`Flight.fail`. ``refresh`` serves a STALE answer's
        background refresh. Policy-bypassed requests lead a flight nobody else joins.
        """
        res = await self.lookup(req)
        if res.status is CacheStatus.HIT:
            return res
        if res.status is CacheStatus.STALE:
            self._schedule_refresh(req, refresh)
            return res
        if not req.cacheable:
            return Flight(self, req, res, None)
        return await self._join_or_lead(req, res, reuse_recent=res.status is not CacheStatus.BYPASS)

    async def get_or_fill(self, req: CacheRequest, fill: Fill) -> CacheResult:
        """Serve from the cache or call ``fill`` once for all concurrent identical misses.

        HIT: the cached answer. STALE: the cached answer, and one background refresh with
        ``fill``. MISS/EXPIRED/BYPASS: the (shared) answer of ``fill``; ``entry`` is None when
        ``fill`` returned None. Policy-bypassed requests (not cacheable) call ``fill``
        directly, without coalescing: each gets its own sample.
        """
        got = await self.claim(req, fill)
        return got if isinstance(got, CacheResult) else await got.run(fill)

    # ------------------------------------------------------------------ stale-while-revalidate

    def _schedule_refresh(self, req: CacheRequest, fill: Fill) -> None:
        digest = req.key.digest
        if self._closed or digest in self._refreshing or digest in self._flights:
            return
        task = asyncio.create_task(self._refresh(req, fill), name=f"semcache-swr-{digest[:12]}")
        self._refreshing[digest] = task
        task.add_done_callback(lambda _t: self._refreshing.pop(digest, None))

    async def _refresh(self, req: CacheRequest, fill: Fill) -> None:
        fresh_req = msgspec.structs.replace(
            req, control=msgspec.structs.replace(req.control, bypass_read=False, no_store=False)
        )
        outcome = "stored"
        try:
            got = await self._join_or_lead(
                fresh_req, CacheResult(status=CacheStatus.MISS, key=req.key), reuse_recent=False
            )
            res = got if isinstance(got, CacheResult) else await got.run(fill)
            if res.entry is None:
                outcome = "incomplete"
            elif not res.stored and not res.coalesced:
                outcome = "not_stored"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = "error"
            log.warning("background refresh of %s failed: %s", req.key.short_id, exc)
        finally:
            if self.metrics:
                self.metrics.refreshes.labels(req.key.model_id, outcome).inc()

    async def wait_refreshes(self) -> None:
        """Wait for the background refreshes in progress (tests, shutdown)."""
        while self._refreshing:
            await asyncio.gather(*list(self._refreshing.values()), return_exceptions=True)

    # ------------------------------------------------------------------ purge and lifecycle

    async def purge(self, kind: str, target: str = "") -> PurgeResult:
        """Purge by ``key`` (digest or short id), ``model``, ``tenant``, ``scope``, ``tag``,
        or ``all``."""
        p = self.purger
        match kind:
            case "key":
                result = await p.purge_key(target)
            case "model":
                result = await p.purge_model(target)
            case "tenant":
                result = await p.purge_tenant(target)
            case "scope":
                result = await p.purge_scope(target)
            case "tag":
                result = await p.purge_tag(target)
            case "all":
                result = await p.purge_all()
            case _:
                raise ValueError(f"unknown purge kind {kind!r}")
        if self.metrics:
            self.metrics.purges.labels(kind).inc()
        return result

    async def start(self) -> None:
        await self.epochs.start()

    async def aclose(self) -> None:
        self._closed = True
        for t in list(self._refreshing.values()):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._refreshing.values(), return_exceptions=True)
        await self.flush()
        await self.epochs.aclose()
        for s in self.lower:
            await s.aclose()
        for link in self._links:
            await link.aclose()


def _resolve_dir(path: str, data_dir: str | Path) -> Path:
    d = Path(path).expanduser()
    return d if d.is_absolute() else Path(data_dir).expanduser() / d


async def open_exact_cache(
    tiers: TierSettings,
    *,
    data_dir: str | Path,
    registry: CollectorRegistry | None = None,
    write_behind: bool = True,
) -> ExactCache:
    """Build the cache from the policy's tier settings and start it (pub/sub listener).

    Relative disk paths are resolved against ``data_dir``. Without a disk tier the purge
    epochs are kept in memory only.
    """
    memory = (
        MemoryStore[CachedAnswer](tiers.memory.max_bytes, sizeof=CachedAnswer.memory_size)
        if tiers.memory.max_bytes > 0
        else None
    )
    lower: list[Store[bytes]] = []
    epoch_dir: Path | None = None
    if tiers.disk.enabled:
        d = _resolve_dir(tiers.disk.dir, data_dir)
        lower.append(DiskStore(d, max_bytes=tiers.disk.max_bytes, eviction=tiers.disk.eviction))
        epoch_dir = d / "epochs"
    local = await asyncio.to_thread(LocalEpochs, epoch_dir)
    book: EpochBook = local
    links: list[RedisLink] = []
    r = tiers.redis
    if r.url:
        link = RedisLink(
            r.url,
            prefix=r.prefix,
            timeout_s=r.timeout_s,
            retry_after_s=r.retry_after_s,
            max_retry_after_s=r.max_retry_after_s,
        )
        links.append(link)
        lower.append(RedisStore(link, namespace="exact"))
        book = RedisEpochs(link, local, recheck_s=r.epoch_recheck_s)
    cache = ExactCache(
        memory=memory,
        lower=lower,
        epochs=book,
        metrics=CacheMetrics(registry) if registry is not None else None,
        links=links,
        write_behind=write_behind,
    )
    await cache.start()
    return cache
