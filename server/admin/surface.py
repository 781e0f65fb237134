"""The admin surface (``/admin``, the admin role), and its debug clock."""

from __future__ import annotations

from typing import Final

from server.admin import api_keys, api_router, debug_clock, pools
from server.surface import Surface

SURFACE: Final = Surface(
    name="admin",
    prefixes=("/admin",),
    routes=(*api_router.ROUTES, *api_keys.ROUTES, *pools.ROUTES),
)

DEBUG_CLOCK: Final = Surface(
    name="admin debug clock",
    prefixes=("/admin/debug",),
    routes=tuple(debug_clock.ROUTES),
)
"""Registered only with ``[debug] adjustable_clock`` (``server/surfaces.py``)."""
