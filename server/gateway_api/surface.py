"""The gateway's own API beside OpenAI's: usage and stored answers, in OpenAI's error shape."""

from __future__ import annotations

from typing import Final

from server.gateway_api import cached_answer, usage
from server.surface import Surface

SURFACE: Final = Surface(
    name="gateway",
    prefixes=("/v1/cache", "/v1/usage"),
    routes=(*cached_answer.ROUTES, *usage.ROUTES),
)
