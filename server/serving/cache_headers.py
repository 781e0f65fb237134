"""HTTP ↔ cache mapping: request headers → `CacheControl`, cache results → response headers.

Request headers (RFC 9111 and Cloudflare AI Gateway):
``Cache-Control: no-cache`` (do not serve from cache), ``no-store`` (do not store),
``max-age=N`` (serve only answers at most N s old); ``cf-aig-skip-cache: true`` (neither
read nor store), ``cf-aig-cache-ttl: N`` (TTL of the stored answer, capped by policy),
``cf-aig-cache-key: K`` (a custom key, also a purge tag), ``x-semcache-tags: a,b``.
Response headers: ``Cache-Status`` (RFC 9211), ``cf-aig-cache-status``, ``Age``,
``x-semcache-key`` (the key's short id) and, on hits, what the hit saved; for caches
downstream (RFC 9111), ``Cache-Control``, ``Vary`` and ``ETag`` (:func:`edge_headers`), and
``If-None-Match`` answered with a 304 (:func:`not_modified`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

import msgspec

from semcache.cache_keys import SHARED_SCOPE
from semcache.entry import CachedAnswer, entry_tag
from semcache.exact import CacheControl, CacheRequest, CacheResult, CacheStatus
from semcache.policy import Prices
from server.http.conditional import NO_STORE


class CacheDirectives(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's headers ask of the cache."""

    control: CacheControl = CacheControl()
    custom_key: str | None = None
    tags: tuple[str, ...] = ()
    semantic_threshold: float | None = None
    """``x-semcache-semantic-threshold``: a stricter similarity threshold for this request
    (the policy's threshold still applies when it is higher: a request never loosens it)."""


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value.strip())
    except ValueError:
        return None
    return n if n >= 0 else None


DIRECTIVE_HEADERS: Final = frozenset(
    {
        "cache-control",
        "cf-aig-skip-cache",
        "cf-aig-cache-ttl",
        "cf-aig-cache-key",
        "x-semcache-tags",
        "x-semcache-semantic-threshold",
    }
)
"""Every request header :func:`directives_from` reads: without them, a request asks the
cache nothing (``CacheDirectives()``)."""


def directives_from(headers: Mapping[str, str]) -> CacheDirectives:
    """Parse the cache-related request headers (unknown or malformed values are ignored)."""
    bypass = no_store = False
    max_age: int | None = None
    for part in (headers.get("cache-control") or "").lower().split(","):
        name, _, value = part.strip().partition("=")
        if name == "no-cache":
            bypass = True
        elif name == "no-store":
            no_store = True
        elif name == "max-age":
            max_age = _int(value.strip('"'))
    if (headers.get("cf-aig-skip-cache") or "").strip().lower() in ("true", "1", "yes"):
        bypass = no_store = True
    ttl = _int(headers.get("cf-aig-cache-ttl"))
    custom = (headers.get("cf-aig-cache-key") or "").strip() or None
    tags = [t.strip() for t in (headers.get("x-semcache-tags") or "").split(",") if t.strip()]
    if custom:
        tags.append(custom)
    return CacheDirectives(
        control=CacheControl(bypass_read=bypass, no_store=no_store, ttl_s=ttl, max_age_s=max_age),
        custom_key=custom,
        tags=tuple(tags),
        semantic_threshold=_unit(headers.get(SEMANTIC_THRESHOLD_HEADER)),
    )


SEMANTIC_THRESHOLD_HEADER = "x-semcache-semantic-threshold"


def _unit(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        x = float(value.strip())
    except ValueError:
        return None
    return x if 0.0 <= x <= 1.0 else None


_RFC9211 = {
    CacheStatus.HIT: "hit",
    CacheStatus.STALE: "hit",
    CacheStatus.MISS: "fwd=uri-miss",
    CacheStatus.EXPIRED: "fwd=stale",
    CacheStatus.BYPASS: "fwd=bypass",
}


def status_headers(
    status: CacheStatus,
    short_id: str,
    *,
    entry: CachedAnswer | None = None,
    age_s: float = 0.0,
    stored: bool = False,
    prices: Prices | None = None,
    age: bool = True,
    saved: bool = True,
) -> dict[str, str]:
    """Response headers describing how the cache handled a request (``age``, ``saved``:
    whether the hit's age and what it saved may be said)."""
    hit = status in (CacheStatus.HIT, CacheStatus.STALE) and entry is not None
    rfc = f"semcache; {_RFC9211[status]}"
    if hit and entry is not None and age:
        rfc += f"; ttl={math.floor(entry.ttl_s - age_s)}"  # negative when stale (RFC 9211)
    elif stored:
        rfc += "; stored"
    rfc += f'; key="{short_id}"'
    out = {"cache-status": rfc, "cf-aig-cache-status": status.value, "x-semcache-key": short_id}
    if hit and entry is not None:
        if age:
            out["age"] = str(int(age_s))
        if saved:
            out.update(
                saved_headers(entry.usage.prompt_tokens, entry.usage.completion_tokens, prices)
            )
    return out


def miss_headers(req: CacheRequest, *, stream: bool = False) -> dict[str, str]:
    """What a miss of ``req`` says: a JSON answer is stored before it is sent (``stored``), a
    stream's headers leave before its answer is complete."""
    stored = not stream and not req.control.no_store
    return status_headers(CacheStatus.MISS, req.key.short_id, stored=stored)


def semantic_headers(
    served: int,
    total: int,
    similarity: float | None,
    short_id: str,
    *,
    stored: bool,
    saved: tuple[int, int] | None = None,
    prices: Prices | None = None,
) -> dict[str, str]:
    """Headers of an answer whose items came (all or some) from semantic matches.

    ``Cache-Status`` says ``hit; detail=semantic`` when every item was served from the
    cache, ``fwd=partial; detail=semantic`` when the backend computed the rest; an exact
    hit never carries ``detail=semantic``. ``saved``: the (prompt, completion) tokens the
    served items spared the backend, said as an exact hit's are (``None``: not to be said).
    """
    full = served == total
    rfc = "semcache; hit" if full else "semcache; fwd=partial"
    if stored:
        rfc += "; stored"
    rfc += f'; detail=semantic; key="{short_id}"'
    out = {
        "cache-status": rfc,
        "cf-aig-cache-status": CacheStatus.HIT.value if full else CacheStatus.MISS.value,
        "x-semcache-key": short_id,
        "x-semcache-semantic": "hit" if full else "partial",
        "x-semcache-semantic-items": f"{served}/{total}",
    }
    if similarity is not None:
        out["x-semcache-similarity"] = f"{similarity:.4f}"
    if saved is not None:
        out.update(saved_headers(*saved, prices))
    return out


def saved_headers(prompt: int, completion: int, prices: Prices | None) -> dict[str, str]:
    """What a cached answer spared the backend: its tokens, and their price."""
    out = {"x-semcache-saved-tokens": str(prompt + completion)}
    if prices is not None:
        out["x-semcache-saved-usd"] = f"{prices.cost_usd(prompt, completion):.8f}"
    return out


def result_headers(
    res: CacheResult, req: CacheRequest | None = None, *, stream: bool = False
) -> dict[str, str]:
    """How the cache answered, within what the request's rule may say (``req.hidden``): under
    a sharing rule that hides hits, every answer says what a miss would (another request's
    answer, a stale or an expired entry included), so no header tells a tenant what another
    tenant sent; the usage ledger and the metrics still count the hit."""
    hidden = req.hidden if req is not None else frozenset()
    if "status" in hidden and res.status is not CacheStatus.BYPASS:
        assert req is not None
        return miss_headers(req, stream=stream)
    return status_headers(
        res.status,
        res.key.short_id,
        entry=res.entry,
        age_s=res.age_s,
        stored=res.stored,
        prices=req.rule.prices if req is not None else None,
        age="age" not in hidden,
        saved="saved" not in hidden,
    )


def edge_headers(res: CacheResult, req: CacheRequest | None = None) -> dict[str, str]:
    """What a downstream HTTP cache may do with an answer (RFC 9111), and its validator.

    Only a stored entry (served from the cache, or stored by this request) may be kept:
    ``public`` when its key is shared across every tenant and its rule reveals hits, else
    ``private`` with ``Vary: Authorization``; ``max-age`` is what is left of the entry's
    freshness here (a cache that ignores ``Age`` then keeps it no longer than the gateway
    does; one that subtracts ``Age`` revalidates earlier, never later); a stale entry must
    be revalidated.
    The strong ``ETag`` is the entry's checksum: a refill or a purge gives another one.
    ``Content-Location`` names the answer's content-addressed URL, ``/v1/cache/{digest}``.
    Anything else (an error, an uncacheable or unstored answer) is ``no-store``. Under a rule
    that hides hits or their age, every storable answer alike is ``private, no-cache`` with
    its ETag and no ``Age``: a lifetime would tell how old the entry is, a content URL that
    another tenant's request stored it.
    """
    entry = res.entry
    if req is not None and not req.hidden.isdisjoint(("status", "age")):
        if entry is None or entry.status != 200 or req.control.no_store:
            return {"cache-control": NO_STORE}
        return {
            "cache-control": "private, no-cache",
            "etag": f'"{entry_tag(entry, res.key.digest)}"',
            "vary": "Authorization",
        }
    if (
        entry is None
        or entry.status != 200
        or entry.created_at <= 0  # not a stored entry: another request's fresh answer
        or not (res.from_cache or res.stored)
    ):
        return {"cache-control": NO_STORE}
    shared = res.key.scope == SHARED_SCOPE
    fresh = math.floor(entry.ttl_s - res.age_s)
    if res.status is CacheStatus.STALE or fresh <= 0:
        lifetime = "max-age=0, must-revalidate"
    else:
        lifetime = f"max-age={fresh}"
    out = {
        "cache-control": f"{'public' if shared else 'private'}, {lifetime}",
        "etag": f'"{entry_tag(entry, res.key.digest)}"',
        "age": str(int(res.age_s)),
    }
    if not shared:
        out["vary"] = "Authorization"
    if entry.key is not None:  # readable again by its digest (server/gateway_api/cached_answer.py)
        out["content-location"] = f"/v1/cache/{res.key.digest}"
    return out


REPRESENTATION_HEADERS: Final = frozenset({"etag", "content-location"})
"""What names one representation: dropped when a route re-shapes an answer (Workers AI's
envelope around an OpenAI answer) — its ETag and URL are the OpenAI body's."""


def reshaped(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` of an answer sent in another shape (no validator, no content URL)."""
    return {k: v for k, v in headers.items() if k.lower() not in REPRESENTATION_HEADERS}
