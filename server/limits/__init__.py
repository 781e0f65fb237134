"""Per-token rate limits and per-tenant budgets: admit a request, or refuse it with a 429.

Counting is done in process (``local_windows``: the `limits` library's fixed windows, in a
dict), or by the `limits` library on Redis when the policy configures ``[tiers.redis]``: then
every gateway on that Redis counts into the same windows and N gateways enforce one limit.
``limiter.TenantLimiter`` is the entry point.
"""
