"""A finished request's usage as a record of the usage ledger (live requests and batch items).

The client's ``usage`` counts every token of its answer; the request's ``RequestUsage``
splits them into what the backends computed (``prompt_tokens``, ``completion_tokens``) and
what the cache answered (``saved_*``). The ledger keeps the client's view in its token
counts, the cached part in ``tokens_saved``, and prices each part at the policy's prices
for the request's model and route: computed → ``cost_usd``, cached → ``saved_usd``. Of the
computed prompt tokens, those vLLM's prefix cache answered are ``prefix_cached_tokens``,
priced at ``cached_input_per_m``; ``prefix_saved_usd`` is what that price saved. A partial
answer (some items from the cache) counts as no hit: its cached items are saved tokens.
"""

from __future__ import annotations

from foundation.request import CacheOutcome, RequestUsage
from semcache.ledger import UsageRecord, utc_day
from semcache.policy import Policy

BATCH_ROUTE = "batch"
"""The ledger's route of batch items (Workers AI ``queueRequest`` and OpenAI batches)."""


def ledger_record(
    *, tenant: str, route: str, usage: RequestUsage, status: int, now: float, policy: Policy
) -> UsageRecord | None:
    """The ledger's record of one ended request; ``None`` when it named no model, or was
    refused without the backends computing anything."""
    if usage.model is None:
        return None
    computed_p, computed_c = usage.prompt_tokens, usage.completion_tokens
    if not 200 <= status < 400 and computed_p + computed_c == 0:
        return None
    saved_p, saved_c = usage.saved_prompt_tokens, usage.saved_completion_tokens
    prices = policy.rule(usage.model, usage.route or "").prices
    return UsageRecord(
        tenant=tenant,
        model=usage.model,
        route=route,
        day=utc_day(now),
        prompt_tokens=computed_p + saved_p,
        completion_tokens=computed_c + saved_c,
        exact_hits=int(usage.cache.exact),
        semantic_hits=int(usage.cache is CacheOutcome.SEMANTIC),  # a partial one is no hit
        tokens_saved=saved_p + saved_c,
        cost_usd=prices.cost_usd(computed_p, computed_c, usage.prefix_cached_tokens),
        saved_usd=prices.cost_usd(saved_p, saved_c),
        prefix_cached_tokens=usage.prefix_cached_tokens,
        prefix_saved_usd=prices.prefix_saved_usd(usage.prefix_cached_tokens),
    )
