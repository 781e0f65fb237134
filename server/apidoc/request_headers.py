"""The request headers the document lists: those ``cache_headers.directives_from`` and the
request context read (unknown or malformed values are ignored, never an error)."""

from __future__ import annotations

from typing import Final

from server.apidoc.operation import Field
from server.serving.cache_headers import SEMANTIC_THRESHOLD_HEADER

STRING: Final = {"type": "string"}

CONTEXT_HEADERS: Final = (
    Field("x-request-id", STRING, "Echoed in the answer's `x-request-id`; default: a new id."),
    Field("x-session-affinity", STRING, "Requests with the same value go to the same vLLM server."),
)

CACHE_HEADERS: Final = (
    Field(
        "cache-control",
        STRING,
        "`no-cache`: do not serve from the cache; `no-store`: do not store; `max-age=N`: "
        "serve only answers at most N seconds old.",
    ),
    Field("cf-aig-skip-cache", STRING, "`true`: neither read nor store."),
    Field("cf-aig-cache-ttl", STRING, "Seconds to keep the answer (capped by the policy)."),
    Field("cf-aig-cache-key", STRING, "A custom cache key (also a purge tag)."),
    Field("x-semcache-tags", STRING, "Comma-separated purge tags of the stored answer."),
    Field(
        SEMANTIC_THRESHOLD_HEADER,
        STRING,
        "A stricter similarity threshold for semantic hits (0 to 1).",
    ),
    *CONTEXT_HEADERS,
)
"""The headers of a cacheable request."""
