"""Request fields shared by the OpenAI families' schemas (``*/protocol.py``).

The structs describe the fields the gateway checks; unknown fields are allowed and the
original body (not these structs) is what reaches the backend, so fields the gateway does
not interpret pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

import msgspec

from foundation.config_types import NonEmptyStr, PosInt

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling fields chat completions and completions share."""

    model: NonEmptyStr
    max_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class TenantRecord(Protocol):
    """A stored object of one tenant (a file, a batch): ``id`` and ``tenant`` fields."""

    id: str
    tenant: str


def public(record: TenantRecord) -> dict[str, Any]:
    """The object as the API answers it: every field but the gateway's own ``tenant``."""
    out: dict[str, Any] = msgspec.to_builtins(record)
    del out["tenant"]
    return out


class ListPage(msgspec.Struct, kw_only=True):
    """One page of a cursor-paginated list (files, batches), as OpenAI answers it."""

    data: list[dict[str, Any]]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: Literal["list"] = "list"

    @classmethod
    def of(cls, records: Sequence[TenantRecord], has_more: bool) -> ListPage:
        return cls(
            data=[public(r) for r in records],
            has_more=has_more,
            first_id=records[0].id if records else None,
            last_id=records[-1].id if records else None,
        )
