"""What the ledger counts: one answered request as a record, and sums of records.

A record is keyed by (day, tenant, model, route); its numeric fields add up. ``Counts`` is
the mutable sum the ledgers keep in memory between two writes.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgspec

KEY_FIELDS: Final[tuple[str, ...]] = ("tenant", "model", "route", "day")
"""The fields a query may group by, in the order they are printed."""

INT_FIELDS: Final[tuple[str, ...]] = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "exact_hits",
    "semantic_hits",
    "tokens_saved",
    "prefix_cached_tokens",
)
FLOAT_FIELDS: Final[tuple[str, ...]] = ("cost_usd", "saved_usd", "prefix_saved_usd")
SUM_FIELDS: Final[tuple[str, ...]] = INT_FIELDS + FLOAT_FIELDS
"""Every numeric field, in storage order (``Counts`` keeps them in a list in this order)."""

_PROMPT, _COMPLETION = SUM_FIELDS.index("prompt_tokens"), SUM_FIELDS.index("completion_tokens")
_USD, _SAVED = SUM_FIELDS.index("cost_usd"), SUM_FIELDS.index("tokens_saved")


def spend_values(values: Sequence[float]) -> tuple[int, float, int]:
    """(tokens, cost_usd, tokens_saved) of one row's sums (``SUM_FIELDS`` order): what a
    budget counts."""
    return int(values[_PROMPT] + values[_COMPLETION]), float(values[_USD]), int(values[_SAVED])


Key = tuple[str, str, str, str]
"""(day, tenant, model, route): one row of storage."""

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")

MAX_QUERY_DAYS: Final = 3660
"""The longest range a query may span (Redis reads one set per day of it)."""


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Usage of one answered request (or a pre-summed group of them)."""

    tenant: str
    model: str
    route: str
    day: str
    """UTC day, ``YYYY-MM-DD`` (see :func:`utc_day`)."""
    requests: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """The ``usage`` the client received, hits included."""
    exact_hits: int = 0
    semantic_hits: int = 0
    tokens_saved: int = 0
    """Tokens answered from the cache instead of a backend."""
    cost_usd: float = 0.0
    """What the backend work cost at the policy's prices (0 for a cache hit)."""
    saved_usd: float = 0.0
    """What a cache hit saved at the policy's prices."""
    prefix_cached_tokens: int = 0
    """Of the prompt tokens the backends computed, those vLLM's prefix cache answered."""
    prefix_saved_usd: float = 0.0
    """What those saved at the policy's ``cached_input_per_m`` (0 when it is unset)."""

    @property
    def key(self) -> Key:
        return (self.day, self.tenant, self.model, self.route)

    def values(self) -> list[float]:
        """The sums in ``SUM_FIELDS`` order."""
        return [
            self.requests,
            self.prompt_tokens,
            self.completion_tokens,
            self.exact_hits,
            self.semantic_hits,
            self.tokens_saved,
            self.prefix_cached_tokens,
            self.cost_usd,
            self.saved_usd,
            self.prefix_saved_usd,
        ]


class Spend(msgspec.Struct, frozen=True):
    """A tenant's usage in one budget period (one UTC day or month)."""

    tokens: int
    """Prompt plus completion tokens, cache hits included."""
    usd: float
    """``cost_usd``: what the backends' work cost (hits cost nothing)."""
    tokens_saved: int = 0
    """The part of ``tokens`` answered from the cache: ``tokens - tokens_saved`` is what a
    budget that does not charge for hits counts."""


def utc_day(t: float) -> str:
    """The UTC day of a Unix time, ``YYYY-MM-DD``."""
    return _day_of(int(t // _DAY_S))


def utc_month(t: float) -> str:
    """The UTC month of a Unix time, ``YYYY-MM``."""
    return _day_of(int(t // _DAY_S))[:7]


_DAY_S = 86_400
"""Unix time counts every UTC day as this many seconds (no leap seconds)."""


@functools.lru_cache(maxsize=8)
def _day_of(day: int) -> str:
    """Day number ``day`` since the epoch, formatted (every request asks for today's)."""
    return time.strftime("%Y-%m-%d", time.gmtime(day * _DAY_S))


class Counts:
    """Sums of records by storage key, kept in memory until they are written."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[Key, list[float]] = {}

    def __bool__(self) -> bool:
        return bool(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, key: Key, values: Sequence[float]) -> None:
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = list(values)
        else:
            for i, v in enumerate(values):
                row[i] += v

    def merge(self, other: Counts) -> None:
        for key, values in other.rows.items():
            self.add(key, values)


def check_query(start: str, end: str, group_by: Sequence[str]) -> tuple[str, ...]:
    """Validate a query's arguments; the group-by fields in canonical order.

    Raises ``ValueError`` with a message fit for a client.
    """
    dates = []
    for name, day in (("start", start), ("end", end)):
        if not _DAY.fullmatch(day):
            raise ValueError(f"{name}: expected a date YYYY-MM-DD, got {day!r}")
        try:
            dates.append(dt.date.fromisoformat(day))
        except ValueError:
            raise ValueError(f"{name}: {day!r} is not a date") from None
    if start > end:
        raise ValueError(f"start ({start}) is after end ({end})")
    if (dates[1] - dates[0]).days >= MAX_QUERY_DAYS:
        raise ValueError(f"start: a query spans at most {MAX_QUERY_DAYS} days")
    unknown = [g for g in group_by if g not in KEY_FIELDS]
    if unknown:
        raise ValueError(
            f"group_by: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"expected any of {', '.join(KEY_FIELDS)}"
        )
    return tuple(f for f in KEY_FIELDS if f in group_by)


def group_rows(
    rows: Iterable[tuple[Mapping[str, str], Sequence[float]]], group_by: Sequence[str]
) -> list[dict[str, object]]:
    """Sum ``(key fields, values)`` rows by ``group_by``; rows sorted by their group."""
    sums: dict[tuple[str, ...], list[float]] = {}
    for keys, values in rows:
        g = tuple(keys[f] for f in group_by)
        acc = sums.get(g)
        if acc is None:
            sums[g] = list(values)
        else:
            for i, v in enumerate(values):
                acc[i] += v
    out: list[dict[str, object]] = []
    for g in sorted(sums):
        row: dict[str, object] = dict(zip(group_by, g, strict=True))
        values = sums[g]
        for i, f in enumerate(SUM_FIELDS):
            row[f] = int(values[i]) if i < len(INT_FIELDS) else float(values[i])
        out.append(row)
    return out
