"""The dashboard surface: the operator's pages over the same figures as ``/metrics``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

from server.dashboard.formats import template_config
from server.dashboard.pages import DashboardState, dashboard_router
from server.dashboard.series import CounterSeries
from server.surface import Services, Surface


def build(services: Services) -> Mapping[str, Any]:
    return {"dashboard": DashboardState(CounterSeries(services.metrics.registry))}


@asynccontextmanager
async def sampling(state: Mapping[str, Any]) -> AsyncIterator[None]:
    """The counters sampled into the pages' series while the app serves."""
    dashboard: DashboardState = state["dashboard"]
    sampler = asyncio.create_task(dashboard.series.run(), name="dashboard-series")
    try:
        yield
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)


SURFACE: Final = Surface(
    name="dashboard",
    prefixes=("/dashboard",),
    routes=(dashboard_router(),),
    build=build,
    lifespan=sampling,
    templates=template_config(),
)
