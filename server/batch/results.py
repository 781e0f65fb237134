"""What one batch item produces: its outcome, the record the queue stores, the usage summed."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from foundation.request import RequestContext


class ItemOutcome(msgspec.Struct, kw_only=True):
    """The answer to one batch item, as the Workers-AI serving object computed it."""

    success: bool
    result: Any = None
    errors: list[dict[str, Any]] = msgspec.field(default_factory=list)
    usage: dict[str, int] | None = None
    retryable: bool = False
    """The backend failed (not the request): trying again later may succeed."""
    response: dict[str, Any] | None = None
    """The stored response object when the runner shapes it itself (an OpenAI batch output
    line); ``None``: the Workers-AI response object."""


class StoredItem(msgspec.Struct, kw_only=True):
    """What the queue keeps per finished item: its response object and its token usage."""

    response: dict[str, Any]
    usage: dict[str, int] | None = None


class ItemRunner(Protocol):
    """Runs one item of a batch through the serving path (caches included)."""

    async def run_item(
        self, model: str, body: dict[str, Any], ctx: RequestContext
    ) -> ItemOutcome: ...


def response_object(
    index: int, outcome: ItemOutcome, external_reference: str | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": index,
        "result": outcome.result if outcome.success else None,
        "success": outcome.success,
        "external_reference": external_reference,
    }
    if not outcome.success:
        out["errors"] = outcome.errors
    return out


USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def sum_usage(usages: list[dict[str, int] | None]) -> dict[str, int]:
    total = dict.fromkeys(USAGE_KEYS, 0)
    for u in usages:
        for k in USAGE_KEYS:
            v = (u or {}).get(k)
            if isinstance(v, int):
                total[k] += v
    return total
