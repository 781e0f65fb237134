"""The exact-match cache: a request's key and policy, lookup, store, fill and purge.

Typical use by the server (which maps headers to :class:`CacheControl`)::

    req = await cache.prepare(route="chat", body=body, model_id=m, revision=rev,
                              rule=policy.rule(m, "chat"), tenant=tenant, control=control)
    result = await cache.get_or_fill(req, fill)     # fill: async () -> CachedAnswer | None
    # result.status: HIT / STALE / MISS / EXPIRED / BYPASS, result.entry, result.age

A caller that must fetch the answer in its own task (a stream relayed as it arrives) uses
``claim`` instead: it returns the result, or a :class:`Flight` to lead and then ``finish``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import msgspec

from foundation import tracing as spans
from semcache.cache_keys import build_key, is_deterministic, scope_for
from semcache.entry import CachedAnswer
from semcache.exact.coalescing import Flight, Flights
from semcache.exact.freshness import freshness
from semcache.exact.purge import EpochBook, LocalEpochs, Purger, PurgeResult
from semcache.exact.request import CacheControl, CacheRequest, CacheResult, CacheStatus, Fill
from semcache.exact.revalidation import Refreshes
from semcache.exact.tier_stack import TierStack
from semcache.metrics import CacheMetrics
from semcache.policy import CacheRule, Prices
from semcache.restamp import restamped
from semcache.tiers import MemoryStore, RedisLink, Store


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
        self.tiers = TierStack(memory, lower, metrics=metrics, write_behind=write_behind)
        self.epochs: EpochBook = epochs or LocalEpochs()
        self.metrics = metrics
        self.clock = clock
        self._links = list(links)
        stores: list[Store[Any]] = [*([memory] if memory is not None else []), *self.lower]
        self.purger = Purger(self.epochs, stores)
        self.flights = Flights(self._put_led, metrics)
        self.refreshes = Refreshes(self.flights, self._fresh_stored, metrics)

    @property
    def memory(self) -> MemoryStore[CachedAnswer] | None:
        return self.tiers.memory

    @property
    def lower(self) -> list[Store[bytes]]:
        return self.tiers.lower

    @property
    def tier_names(self) -> list[str]:
        return self.tiers.names

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
        scope: str | None = None,
        control: CacheControl | None = None,
        tags: Sequence[str] = (),
        chat_template_fp: str = "",
        custom_key: str | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> CacheRequest:
        """Build the versioned, scoped key of a request and decide whether it may be cached.

        ``scope``: the key scope the policy gives the request (``Policy.scope``); without
        it, ``tenant``'s own, or ``shared`` when the rule shares with every tenant.
        ``custom_key`` (``cf-aig-cache-key``) replaces the body's params in the key, within the
        same scope, model, revision and template. Non-deterministic requests are not cached
        when the rule says ``deterministic_only``.
        """
        epochs = await self.epochs.snapshot()
        if scope is None:
            scope = scope_for(tenant, shared=rule.shared is True)
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

    async def lookup(self, req: CacheRequest) -> CacheResult:
        """Look the request up; counts metrics. Never calls a backend."""
        t0 = time.perf_counter()
        if not req.cacheable or req.control.bypass_read:
            res = CacheResult(status=CacheStatus.BYPASS, key=req.key)
        else:
            res = await self._search(req)
        self.count(req, res, t0)
        return self._undisclosed(req, res)

    def _undisclosed(self, req: CacheRequest, res: CacheResult) -> CacheResult:
        """Under a rule that hides hits (``req.hidden``), an answer another request stored
        gets new ids and creation times, as a newly made one would have."""
        if res.entry is not None and (res.from_cache or res.coalesced) and "status" in req.hidden:
            res.entry = restamped(res.entry, self.clock())
        return res

    async def fresh_hit(self, req: CacheRequest) -> CacheResult | None:
        """The request's fresh answer (a HIT), counted by nobody yet: the caller serves it
        and then calls :meth:`count`. ``None`` whenever :meth:`lookup` would say anything
        but HIT; nothing is counted then, and a later :meth:`lookup` finds the same."""
        if not req.cacheable or req.control.bypass_read:
            return None
        res = await self._search(req)
        return self._undisclosed(req, res) if res.status is CacheStatus.HIT else None

    async def _search(self, req: CacheRequest) -> CacheResult:
        if not spans.recording():
            return await self._walk(req, traced=False)
        with spans.span("cache.exact", {"semcache.route": req.route}) as span:
            res = await self._walk(req, traced=True)
            if span is not None:
                span.set_attribute("semcache.status", res.status.value)
                if res.tier is not None:
                    span.set_attribute("semcache.tier", res.tier)
        return res

    async def _walk(self, req: CacheRequest, *, traced: bool) -> CacheResult:
        now = self.clock()
        found, expired = await self.tiers.find(req, now, traced=traced)
        if found is None:
            status = CacheStatus.EXPIRED if expired else CacheStatus.MISS
            return CacheResult(status=status, key=req.key)
        if found.index > 0:
            await self.tiers.backfill(req, found, now)
        return CacheResult(
            status=found.status,
            key=req.key,
            entry=found.entry,
            age_s=found.age_s,
            tier=self.tiers.store_at(found.index).tier,
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
        res = await self._read_digest(digest, CacheControl())
        if res is not None and self.metrics and res.entry is not None and res.tier is not None:
            self.metrics.served(
                res.key.model_id,
                res.tier,
                res.entry,
                Prices(),
                stale=res.status is CacheStatus.STALE,
            )
        return res

    async def lookup_ref(self, req: CacheRequest, digest: str) -> CacheResult:
        """The answer stored under ``digest`` (the entry a semantic record points to), read
        on behalf of ``req``: served only when its key answers ``req``'s scope, model and
        revision (content rules included), under ``req``'s cache control; counted as
        ``req``'s lookup. The stored digest is the key: no second key is built for it."""
        t0 = time.perf_counter()
        if not req.cacheable or req.control.bypass_read:
            res = CacheResult(status=CacheStatus.BYPASS, key=req.key)
        else:
            found = await self._read_digest(digest, req.control)
            mine = req.key
            if found is None or (found.key.scope, found.key.model_id, found.key.revision) != (
                mine.scope,
                mine.model_id,
                mine.revision,
            ):
                res = CacheResult(status=CacheStatus.MISS, key=req.key)
            else:
                res = found
        self.count(req, res, t0)
        return self._undisclosed(req, res)

    async def _read_digest(self, digest: str, control: CacheControl) -> CacheResult | None:
        """The servable entry under ``digest`` in the first tier that holds one, uncounted."""
        epochs = await self.epochs.snapshot()
        now = self.clock()
        for i in range(len(self.tiers)):
            entry, _ = await self.tiers.read(i, digest)
            key = entry.key if entry is not None else None
            if entry is None or key is None or key.digest != digest:
                continue
            current = epochs.for_key(key.model_id, key.scope) == key.epochs
            if not current or epochs.purged(key.short_id, entry.tags, entry.epochs):
                continue
            status, age = freshness(entry, control, now)
            if status is CacheStatus.EXPIRED:
                continue
            tier = self.tiers.store_at(i).tier
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
        await self.tiers.store(key.digest, entry, float(ttl + entry.swr_s), through=write_through)
        if self.metrics:
            self.metrics.stores.labels(key.model_id).inc()
        return entry

    async def _put_led(self, req: CacheRequest, answer: CachedAnswer) -> CachedAnswer | None:
        """Store the answer a flight's leader fetched."""
        return await self.put(req, answer, write_through=req.write_through)

    async def flush(self) -> None:
        """Commit the background writes started so far."""
        await self.tiers.flush()

    # ------------------------------------------------------------------ fill

    async def _memory_fresh(self, req: CacheRequest) -> CachedAnswer | None:
        """An answer a just-finished leader stored (closes the gap after its flight ended)."""
        if self.memory is None:
            return None
        entry = await self.memory.get(req.key.digest)
        if entry is None or req.epochs.purged(req.key.short_id, entry.tags, entry.epochs):
            return None
        status, _ = freshness(entry, req.control, self.clock())
        return entry if status is CacheStatus.HIT else None

    async def _fresh_stored(self, req: CacheRequest) -> bool:
        """Whether a tier holds a fresh answer to the request (a refresh asks before fetching)."""
        found, _ = await self.tiers.find(req, self.clock())
        return found is not None and found.status is CacheStatus.HIT

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
            self.refreshes.schedule(req, refresh)
            return res
        if not req.cacheable:
            return self.flights.alone(req, res)
        # a bypass_read request takes no answer stored since its (skipped) lookup
        recent = partial(self._memory_fresh, req) if res.status is not CacheStatus.BYPASS else None
        got = await self.flights.join_or_lead(req, res, recent)
        return self._undisclosed(req, got) if isinstance(got, CacheResult) else got

    async def get_or_fill(self, req: CacheRequest, fill: Fill) -> CacheResult:
        """Serve from the cache or call ``fill`` once for all concurrent identical misses.

        HIT: the cached answer. STALE: the cached answer, and one background refresh with
        ``fill``. MISS/EXPIRED/BYPASS: the (shared) answer of ``fill``; ``entry`` is None when
        ``fill`` returned None. Policy-bypassed requests (not cacheable) call ``fill``
        directly, without coalescing: each gets its own sample.
        """
        got = await self.claim(req, fill)
        return got if isinstance(got, CacheResult) else await got.run(fill)

    async def wait_refreshes(self) -> None:
        """Wait for the background refreshes in progress (tests, shutdown)."""
        await self.refreshes.wait()

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
        self.tiers.closed = True  # what is still written goes through, not behind
        await self.refreshes.aclose()
        await self.flush()
        await self.epochs.aclose()
        await self.tiers.aclose()
        for link in self._links:
            await link.aclose()
