"""The Anthropic surface: the Messages API on ``/v1/messages``, in Anthropic's shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from server.anthropic import api_router
from server.anthropic.errors import ANTHROPIC_ERRORS
from server.anthropic.serving import MessagesServing, hit_reply
from server.surface import Services, Surface, Watched


def build(services: Services) -> Mapping[str, Any]:
    return {"anthropic": MessagesServing(services.core, services.generation, services.tokens)}


SURFACE: Final = Surface(
    name="Anthropic",
    prefixes=("/v1/messages",),
    routes=tuple(api_router.ROUTES),
    errors=ANTHROPIC_ERRORS,
    # Anthropic's SDK and Claude Code send the key as `x-api-key`: the same tenants and keys
    # as `Authorization: Bearer`. Elsewhere it is ignored (answers there vary on
    # `Authorization` alone).
    key_headers=("x-api-key",),
    early_hits={"/v1/messages": Watched("chat", "chat", hit_reply)},
    build=build,
)
