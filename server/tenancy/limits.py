"""Per-token limits (placeholder settings; the limiter itself lands with the limits work)."""

from __future__ import annotations

import msgspec

from semcache.config_types import PosFloat, PosInt


class LimitSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    requests_per_minute: PosInt | None = None
    tokens_per_minute: PosInt | None = None
    concurrent_requests: PosInt | None = None
    daily_tokens: PosInt | None = None
    monthly_tokens: PosInt | None = None
    daily_usd: PosFloat | None = None
    monthly_usd: PosFloat | None = None
    hits_spend_tokens: bool = False
