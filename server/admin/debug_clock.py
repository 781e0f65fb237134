"""``/admin/debug/clock``: read, move or freeze the gateway's calendar clock.

Registered only with ``[debug] adjustable_clock = true`` (server/config.py); the admin role,
like every admin route.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get, post

from foundation.clock import AdjustableClock, ClockState
from server.admin.api_router import ADMIN_ERRORS
from server.apidoc.operation import Answer, RouteDoc, documented
from server.envelope.context import require_admin
from server.http.respond import parse_body


class ClockChange(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    advance_s: float = 0.0
    """Seconds to move the clock by (negative: back)."""
    freeze: bool | None = None
    """True holds the time still (after the move), false lets it run; absent: as it is."""


def _answer(clock: AdjustableClock) -> Response[bytes]:
    return Response(msgspec.json.encode(clock.state()), media_type="application/json")


@get(
    "/admin/debug/clock",
    opt={"auth": "admin"},
    operation_class=documented(
        RouteDoc(
            summary="Read the gateway's clock",
            tag="Admin",
            description="Only with `[debug] adjustable_clock = true`. Needs the admin role.",
            answers=(Answer(200, ClockState, "The gateway's time and its offset."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def read_clock(request: Request[Any, Any, Any]) -> Response[bytes]:
    require_admin(request)
    return _answer(request.app.state.clock)


@post(
    "/admin/debug/clock",
    opt={"auth": "admin"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Move or freeze the gateway's clock",
            tag="Admin",
            description="Cache ages, TTLs and stale windows, budget periods and ledger days "
            "follow it. Only with `[debug] adjustable_clock = true`. Needs the admin role.",
            body=ClockChange,
            answers=(Answer(200, ClockState, "The clock after the change."),),
            errors=ADMIN_ERRORS,
        )
    ),
)
async def change_clock(request: Request[Any, Any, Any]) -> Response[bytes]:
    require_admin(request)
    change = msgspec.convert(parse_body(await request.body()), ClockChange)
    clock: AdjustableClock = request.app.state.clock
    clock.advance(change.advance_s)
    if change.freeze is not None:
        clock.freeze(change.freeze)
    return _answer(clock)


ROUTES = [read_clock, change_clock]
