"""The 429 errors a limit or a budget raises, worded as OpenAI words them."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime

from server.errors import ApiError
from server.limits.headers import format_reset
from server.limits.windows import Window


def rate_limited(
    kind: str, cost: int, window: Window, clock: Callable[[], float], headers: dict[str, str]
) -> ApiError:
    """A request refused by its ``kind`` window (``requests`` or ``tokens``), which it would
    have taken ``cost`` of."""
    wait = max(1, math.ceil(window.reset_at - clock()))
    unit = "requests per min (RPM)" if kind == "requests" else "tokens per min (TPM)"
    used = window.limit - window.remaining
    message = (
        f"Rate limit reached for {unit}: Limit {window.limit}, Used {used}, "
        f"Requested {cost}. Please try again in {format_reset(window.reset_at - clock())}."
    )
    if kind == "tokens" and cost > window.limit:
        message = (
            f"Request too large for tokens per min (TPM): Limit {window.limit}, "
            f"Requested about {cost} (prompt estimate plus max_tokens). Send a shorter "
            "request or a smaller max_tokens."
        )
    return ApiError(
        429, message, code="rate_limit_exceeded", type=kind, retry_after_s=wait, headers=headers
    )


def too_many_concurrent(limit: int | None, headers: dict[str, str]) -> ApiError:
    """A request refused because its token has ``limit`` requests in flight already."""
    return ApiError(
        429,
        f"Too many concurrent requests: Limit {limit}. Please retry when one has finished.",
        code="rate_limit_exceeded",
        type="requests",
        retry_after_s=1,
        headers=headers,
    )


def quota_exceeded(reached: str, reset: float, now: float, headers: dict[str, str]) -> ApiError:
    """A request refused because its tenant's budget (``reached``, in words) renews at
    ``reset`` only."""
    when = datetime.fromtimestamp(reset, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return ApiError(
        429,
        f"You exceeded your current quota: the {reached} is reached. It renews at {when}.",
        code="insufficient_quota",
        type="insufficient_quota",
        retry_after_s=max(1, math.ceil(reset - now)),
        headers=headers,
    )
