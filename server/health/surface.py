"""The health surface: the root, the probes and the metrics scrape, open to all."""

from __future__ import annotations

from typing import Final

from server.errors import ApiError
from server.health import probes, scrape
from server.surface import Surface


def _draining(err: ApiError) -> bytes:
    return b'{"status":"draining"}'


SURFACE: Final = Surface(
    name="health",
    prefixes=("/health", "/ready", "/metrics"),
    routes=(*probes.ROUTES, *scrape.ROUTES),
    open_while_draining=frozenset({"/health", "/metrics"}),
    refusal=_draining,  # `/ready` says why it is not ready: the balancer moves on
)
