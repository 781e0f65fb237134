"""OpenAI's ``x-ratelimit-*`` response headers, from the rate windows a request counted in."""

from __future__ import annotations

import math

from server.limits.windows import Window

_REQUESTS_HEADERS = (
    b"x-ratelimit-limit-requests",
    b"x-ratelimit-remaining-requests",
    b"x-ratelimit-reset-requests",
)
_TOKENS_HEADERS = (
    b"x-ratelimit-limit-tokens",
    b"x-ratelimit-remaining-tokens",
    b"x-ratelimit-reset-tokens",
)


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI's ``x-ratelimit-reset-*`` headers write it: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_headers(
    requests: Window | None, tokens: Window | None, now: float
) -> list[tuple[bytes, bytes]]:
    """The headers of the requests and tokens windows a request has, as ASGI carries them."""
    out: list[tuple[bytes, bytes]] = []
    for names, window in ((_REQUESTS_HEADERS, requests), (_TOKENS_HEADERS, tokens)):
        if window is None:
            continue
        limit, remaining, reset = names
        out.append((limit, str(window.limit).encode()))
        out.append((remaining, str(max(0, window.remaining)).encode()))
        out.append((reset, format_reset(window.reset_at - now).encode()))
    return out
