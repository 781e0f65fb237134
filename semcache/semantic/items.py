"""Per-input-item caching for pooling routes (embeddings, classification).

A request with many inputs is answered item by item: each input text is looked up in the
semantic index of its partition; a match is served from the item's answer, kept in the
exact tiers under an *item key* (route ``<route>.item``, body ``{"input": text}``). Only
the misses go to the backend; their answers are stored as items and indexed.

The item key is rebuilt from the matched text at lookup time, with the current purge
epochs, so every purge of the exact cache (model, tenant, scope, all, key, tag) applies to
semantic hits too: a purged item is a miss, and its index entry is dropped.

The partition of a request comes from its exact key: scope (tenant or ``shared``), model
id and revision, template fingerprint and purge epochs, plus the route (task). A search
never leaves it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import msgspec
import numpy as np

from semcache.cache_keys import CacheKey
from semcache.entry import CachedAnswer, Usage
from semcache.exact import CacheControl, CacheRequest, ExactCache
from semcache.semantic.cache import SemanticCache
from semcache.semantic.match import Match
from semcache.semantic.records import PartitionKey

ITEM_CONTENT_TYPE = "application/x-semcache-item"


class ItemHit(msgspec.Struct, frozen=True, kw_only=True):
    """A cached item answer served for one input text."""

    payload: bytes
    """The item's stored answer bytes (what the caller stored with :meth:`ItemCache.store`)."""
    tokens: int
    """Tokens the backend counted for the matched text when it computed the answer."""
    similarity: float
    matched_text: str


class ItemLookup(msgspec.Struct, kw_only=True):
    """The per-item outcome of one request."""

    hits: list[ItemHit | None]
    vectors: np.ndarray | None
    """The cache encoder's vectors of the inputs (reused when indexing the misses)."""
    partition: PartitionKey | None

    @property
    def miss_indices(self) -> list[int]:
        return [i for i, hit in enumerate(self.hits) if hit is None]

    @property
    def served(self) -> int:
        return sum(hit is not None for hit in self.hits)

    @property
    def min_similarity(self) -> float | None:
        values = [hit.similarity for hit in self.hits if hit is not None]
        return min(values) if values else None


def label_margin(probs: Sequence[float]) -> float:
    """Log-odds margin of the top label over the next one (inf with a single label)."""
    if len(probs) < 2:
        return math.inf
    top, second = sorted(probs, reverse=True)[:2]
    if second <= 0.0:
        return math.inf
    return math.log(max(top, 1e-300) / second)


def partition_of(semantic: SemanticCache, key: CacheKey, task: str) -> PartitionKey:
    """The hard partition of a request, from its exact key (everything but the text)."""
    return semantic.partition_key(
        scope=key.scope,
        model_revision=f"{key.model_id}@{key.revision}",
        task=task,
        template=f"{key.template_fp}/e{key.epochs[0]}.{key.epochs[1]}.{key.epochs[2]}",
    )


class ItemCache:
    """Semantic per-item lookups and stores on top of the exact cache."""

    def __init__(self, exact: ExactCache, semantic: SemanticCache) -> None:
        self.exact = exact
        self.semantic = semantic

    @staticmethod
    def _item_request(creq: CacheRequest, text: str) -> CacheRequest:
        return creq.part(f"{creq.route}.item", {"input": text})

    async def lookup(
        self,
        creq: CacheRequest,
        texts: Sequence[str],
        *,
        tighten_threshold: float | None = None,
    ) -> ItemLookup:
        """For each text, the cached item to serve (or None); never calls a backend."""
        rule = creq.rule.semantic
        none: list[ItemHit | None] = [None] * len(texts)
        if not rule.enabled or not creq.cacheable or not texts:
            return ItemLookup(hits=none, vectors=None, partition=None)
        partition = partition_of(self.semantic, creq.key, creq.route)
        vectors = await self.semantic.encode(texts)
        if creq.control.bypass_read:
            return ItemLookup(hits=none, vectors=vectors, partition=partition)
        matches = await self.semantic.lookup(
            partition, texts, rule, tighten_threshold, vectors=vectors
        )
        found = await asyncio.gather(*(self._fetch(creq, partition, m) for m in matches))
        return ItemLookup(hits=list(found), vectors=vectors, partition=partition)

    async def _fetch(
        self, creq: CacheRequest, partition: PartitionKey, match: Match | None
    ) -> ItemHit | None:
        if match is None:
            return None
        # the record's digest is the item's key: read in the request's scope and revision
        res = await self.exact.lookup_ref(creq, match.payload_ref)
        entry = res.entry
        if not res.from_cache or entry is None or not entry.body:
            # Purged, expired or evicted in the exact tiers: drop the index entry too.
            await self.semantic.remove(partition, [match.payload_ref])
            return None
        return ItemHit(
            payload=entry.body,
            tokens=entry.usage.prompt_tokens,
            similarity=match.similarity,
            matched_text=match.text,
        )

    async def store(
        self,
        creq: CacheRequest,
        lookup: ItemLookup,
        texts: Sequence[str],
        payloads: Sequence[bytes],
        tokens: Sequence[int],
        indices: Sequence[int],
    ) -> int:
        """Store the backend's answers of the inputs at ``indices`` and index them.

        ``texts``, ``payloads`` and ``tokens`` are per stored item (same length as
        ``indices``, the items' positions in the request). Returns how many were stored.
        """
        rule = creq.rule.semantic
        if not rule.enabled or lookup.partition is None or lookup.vectors is None or not texts:
            return 0
        if not creq.cacheable or creq.control.no_store:
            return 0
        items = [self._item_request(creq, text) for text in texts]

        async def put(item: CacheRequest, payload: bytes, count: int) -> bool:
            answer = CachedAnswer(
                body=payload,
                content_type=ITEM_CONTENT_TYPE,
                usage=Usage(prompt_tokens=count),
                model_id=creq.key.model_id,
            )
            # Written through: the answer is on disk before the durable semantic record
            # that points to it, so a crash never leaves a record without its answer.
            return await self.exact.store(item, answer, write_through=True)

        stored = await asyncio.gather(
            *(put(i, p, c) for i, p, c in zip(items, payloads, tokens, strict=True))
        )
        kept = [n for n, ok in enumerate(stored) if ok]
        refs = [items[n].key.digest for n in kept]
        ttl = _ttl(items[0].control, items[0].rule.ttl_s, items[0].rule.max_ttl_s) if kept else 0
        if not kept:
            return 0
        rows = [indices[n] for n in kept]
        await self.semantic.insert(
            lookup.partition,
            [texts[n] for n in kept],
            refs,
            float(ttl),
            rule=rule,
            vectors=lookup.vectors[rows],
        )
        return len(kept)


def _ttl(control: CacheControl, ttl_s: int, max_ttl_s: int) -> int:
    ttl = control.ttl_s if control.ttl_s is not None else ttl_s
    return max(0, min(ttl, max_ttl_s))
