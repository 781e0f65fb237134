"""The dashboard surface: the operator's pages over the same figures as ``/metrics``."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

from server.dashboard.formats import template_config
from server.dashboard.pages import DashboardState, dashboard_router
from server.dashboard.series import CounterSeries
from server.surface import Services, Surface, running


def build(services: Services) -> Mapping[str, Any]:
    return {"dashboard": DashboardState(CounterSeries(services.metrics.registry))}


def sampling(state: Mapping[str, Any]) -> AbstractAsyncContextManager[None]:
    """The counters sampled into the pages' series while the app serves."""
    dashboard: DashboardState = state["dashboard"]
    return running(dashboard.series.run(), "dashboard-series")


SURFACE: Final = Surface(
    name="dashboard",
    prefixes=("/dashboard",),
    routes=(dashboard_router(),),
    build=build,
    lifespan=sampling,
    templates=template_config(),
)
