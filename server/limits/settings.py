"""The limits of one API token: the ``[limits]`` defaults, or a token entry's override."""

from __future__ import annotations

import msgspec

from foundation.config_types import PosFloat, PosInt


class LimitSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Limits of one token: the ``[limits]`` defaults, or a token entry's ``limits`` override.

    Every field left out (``None``) means no limit, or, in an override, the default's value.
    """

    requests_per_minute: PosInt | None = None
    tokens_per_minute: PosInt | None = None
    """Prompt (estimated at admission, reconciled with ``usage`` after) plus completion."""
    concurrent_requests: PosInt | None = None
    """Requests in flight at once, per gateway."""
    daily_tokens: PosInt | None = None
    monthly_tokens: PosInt | None = None
    daily_usd: PosFloat | None = None
    monthly_usd: PosFloat | None = None
    """Budgets of the token's tenant, read from the usage ledger; days and months are UTC.

    The USD budgets count what the backends' work cost: a cache hit costs nothing."""
    hits_spend_tokens: bool | None = None
    """Whether cache hits spend tokens per minute and the token budgets (default false: that
    is what a cache is for). A hit always counts as a request."""

    def merged(self, override: LimitSettings | None) -> LimitSettings:
        """These defaults with every field the override sets replaced by the override's."""
        if override is None:
            return self
        changes = {
            name: value
            for name in override.__struct_fields__
            if (value := getattr(override, name)) is not None
        }
        return msgspec.structs.replace(self, **changes) if changes else self

    # Read on every request: plain comparisons, not a loop over the fields.
    @property
    def limited(self) -> bool:
        """Whether any limit or budget is set."""
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or self.concurrent_requests is not None
            or self.budgets
        )

    @property
    def estimates_tokens(self) -> bool:
        """Whether admission needs the request's token estimate: tokens per minute, or a
        token budget (which reserves it)."""
        return (
            self.tokens_per_minute is not None
            or self.daily_tokens is not None
            or self.monthly_tokens is not None
        )

    @property
    def budgets(self) -> bool:
        return (
            self.daily_tokens is not None
            or self.monthly_tokens is not None
            or self.daily_usd is not None
            or self.monthly_usd is not None
        )
