"""What a request used and saved, noted on its context as the serving path learns it."""

from __future__ import annotations

from collections.abc import Mapping

from foundation.request import RequestUsage
from semcache.exact import CacheResult, CacheStatus

_USAGE_NAMES = (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens"))


def tokens_of(usage: Mapping[str, object] | None) -> tuple[int, int]:
    """``(prompt, completion)`` of an OpenAI ``usage`` object (the Responses API's names too)."""
    if not usage:
        return 0, 0
    out = []
    for name, alias in _USAGE_NAMES:
        value = usage.get(name, usage.get(alias))
        out.append(value if isinstance(value, int) and value > 0 else 0)
    return out[0], out[1]


def note_result(usage: RequestUsage, res: CacheResult) -> None:
    """How the exact cache answered; a hit (or another request's answer, coalesced) saved
    the stored answer's tokens."""
    entry = res.entry
    if res.from_cache or res.coalesced:
        usage.cache = "stale" if res.status is CacheStatus.STALE else "exact"
        if entry is not None and entry.status == 200:
            usage.saved(entry.usage.prompt_tokens, entry.usage.completion_tokens)
    elif res.status is CacheStatus.BYPASS:
        usage.cache = "bypass"
    else:
        usage.cache = "miss"


def note_semantic(
    usage: RequestUsage, served: int, total: int, prompt: int, completion: int
) -> None:
    """``served`` of ``total`` items came from semantic matches, sparing these tokens."""
    usage.cache = "semantic" if served == total else "partial"
    usage.saved(prompt, completion)
