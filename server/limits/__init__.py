"""Per-token rate limits and per-tenant budgets: admit a request, or refuse it with a 429.

Counting is done by the `limits` library on its in-process memory storage, or on Redis when
the policy configures ``[tiers.redis]``: then every gateway on that Redis counts into the
same windows and N gateways enforce one limit. ``limiter.TenantLimiter`` is the entry point.
"""
