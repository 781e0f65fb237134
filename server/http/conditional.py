"""Conditional requests and what caches downstream may keep (RFC 9110, RFC 9111): the
``no-store`` of uncacheable answers, ``If-None-Match`` against an answer's ETag, the 304."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

NO_STORE: Final = "no-store"
"""``Cache-Control`` of every answer no cache may keep: errors, uncached and uncacheable answers."""


NOT_MODIFIED_HEADERS: Final = frozenset(
    {"cache-control", "etag", "vary", "age", "content-location", "expires", "date"}
)
"""What a 304 repeats of the 200 it stands for (RFC 9110 §15.4.5), with the cache's own."""


def etag_matches(if_none_match: str | None, etag: str | None) -> bool:
    """``If-None-Match`` against a response's ETag, by weak comparison (RFC 9110 §13.1.2)."""
    if not if_none_match or not etag:
        return False
    if if_none_match.strip() == "*":
        return True
    opaque = etag.removeprefix("W/")
    return any(
        tag.strip().removeprefix("W/") == opaque for tag in if_none_match.split(",") if tag.strip()
    )


def not_modified(headers: Mapping[str, str], if_none_match: str | None) -> dict[str, str] | None:
    """The headers of a 304 when ``If-None-Match`` names the answer's ETag, else ``None``."""
    if not etag_matches(if_none_match, headers.get("etag")):
        return None
    keep = NOT_MODIFIED_HEADERS | {"cache-status", "cf-aig-cache-status", "x-semcache-key"}
    return {k: v for k, v in headers.items() if k.lower() in keep}
