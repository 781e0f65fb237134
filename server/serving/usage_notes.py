"""What a request used and saved, noted on its context as the serving path learns it.

The one place a request's :class:`~foundation.request.CacheOutcome` is set: each function
below is called where the answer is decided, and every reader (the ledger, the limits,
``/metrics``, the request log, the traces) reads the value it leaves."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from foundation.request import CacheOutcome, RequestUsage
from semcache.exact import CacheResult, CacheStatus

_USAGE_NAMES = (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens"))


def tokens_of(usage: Mapping[str, object] | None) -> tuple[int, int, int]:
    """``(prompt, completion, prefix-cached prompt)`` tokens of an OpenAI ``usage`` object
    (the Responses API's names too)."""
    if not usage:
        return 0, 0, 0
    out = []
    for name, alias in _USAGE_NAMES:
        value = usage.get(name, usage.get(alias))
        out.append(value if isinstance(value, int) and value > 0 else 0)
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    out.append(cached if isinstance(cached, int) and cached > 0 else 0)
    return out[0], out[1], out[2]


def prefix_cached_of(body: bytes) -> int:
    """The prompt tokens vLLM's prefix cache answered, from a JSON answer's ``usage``."""
    if b'"cached_tokens"' not in body:  # no second parse of an answer that names none
        return 0
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return 0
    return tokens_of(usage)[2] if isinstance(usage, dict) else 0


def note_result(usage: RequestUsage, res: CacheResult) -> None:
    """How the exact cache answered; a hit (or another request's answer, coalesced) saved
    the stored answer's tokens."""
    entry = res.entry
    if res.from_cache or res.coalesced:
        usage.cache = CacheOutcome.STALE if res.status is CacheStatus.STALE else CacheOutcome.EXACT
        if entry is not None and entry.status == 200:
            usage.saved(entry.usage.prompt_tokens, entry.usage.completion_tokens)
    else:
        note_uncached(usage, bypass=res.status is CacheStatus.BYPASS)


def note_uncached(usage: RequestUsage, *, bypass: bool) -> None:
    """The backends answer: the client's directives skipped the lookup, or it missed."""
    usage.cache = CacheOutcome.BYPASS if bypass else CacheOutcome.MISS


def note_items(usage: RequestUsage, served: int, total: int, prompt: int, completion: int) -> None:
    """``served`` of ``total`` items (scoring pairs) came from their exact entries, sparing
    these tokens: every item is an exact hit; some are a partial answer (not a hit)."""
    usage.cache = CacheOutcome.EXACT if served == total else CacheOutcome.PARTIAL
    usage.saved(prompt, completion)


def note_semantic(
    usage: RequestUsage, served: int, total: int, prompt: int, completion: int
) -> None:
    """``served`` of ``total`` items came from semantic matches, sparing these tokens."""
    usage.cache = CacheOutcome.SEMANTIC if served == total else CacheOutcome.PARTIAL
    usage.saved(prompt, completion)
