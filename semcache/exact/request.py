"""What one exact-cache lookup is about and what it returns: status, control, request, result."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Any

import msgspec

from semcache.cache_keys import CacheKey, build_key, is_tenant_scope
from semcache.entry import CachedAnswer
from semcache.exact.purge import Epochs
from semcache.policy import REVEALABLE, CacheRule

Fill = Callable[[], Awaitable[CachedAnswer | None]]
"""Fetches a miss's answer from the backend; ``None`` when the answer is incomplete."""


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
    """Everything the cache needs about one request; built by ``ExactCache.prepare``."""

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

    def part(self, route: str, body: Mapping[str, Any]) -> CacheRequest:
        """The request for one part of this one (an embedding item, a scoring pair), the
        one way such a key is derived: this request's scope, model, revision and purge
        epochs, control and tags, with ``body`` as its params. A part of a pooling route is
        deterministic whatever the rule says of sampling."""
        key = self.key
        part_key = build_key(
            route=route,
            body=body,
            scope=key.scope,
            model_id=key.model_id,
            revision=key.revision,
            epochs=key.epochs,
        )
        rule = msgspec.structs.replace(self.rule, deterministic_only=False)
        return CacheRequest(
            key=part_key,
            route=route,
            rule=rule,
            control=self.control,
            epochs=self.epochs,
            tags=self.tags,
            cacheable=rule.cacheable,
        )

    @property
    def hidden(self) -> frozenset[str]:
        """What this request's response may not say of the cache (:data:`Reveal` names):
        nothing is hidden in a tenant's own scope; under a sharing rule, all the rule does
        not ``reveal``, so no tenant learns from a header what another tenant sent."""
        if is_tenant_scope(self.key.scope):
            return frozenset()
        return REVEALABLE.difference(self.rule.reveal)


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
