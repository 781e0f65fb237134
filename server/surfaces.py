"""The surfaces this gateway serves: the one place a surface is registered."""

from __future__ import annotations

from server.admin.surface import DEBUG_CLOCK
from server.admin.surface import SURFACE as ADMIN
from server.anthropic.surface import SURFACE as ANTHROPIC
from server.config import GatewayConfig
from server.dashboard.surface import SURFACE as DASHBOARD
from server.gateway_api.surface import SURFACE as GATEWAY_API
from server.health.surface import SURFACE as HEALTH
from server.openai.surface import SURFACE as OPENAI
from server.surface import Surface
from server.workers_ai.surface import SURFACE as WORKERS_AI


def builtin_surfaces(config: GatewayConfig) -> list[Surface]:
    """Every built-in surface ``config`` turns on."""
    surfaces = [HEALTH, OPENAI, ANTHROPIC, WORKERS_AI, GATEWAY_API, ADMIN, DASHBOARD]
    if config.debug.adjustable_clock:
        surfaces.append(DEBUG_CLOCK)
    return surfaces
