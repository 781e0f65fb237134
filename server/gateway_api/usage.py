"""``GET /v1/usage``: the usage ledger's sums, grouped as asked.

Query: ``start`` and ``end`` (UTC days ``YYYY-MM-DD``, both included; default the 1st of
this month to today), ``group_by`` (comma-separated: any of tenant, model, route, day;
default ``tenant,model,day``; empty: one total) and, for an admin, ``tenant``. A token sees
its own tenant's rows only; an admin's sees every tenant's.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from litestar import Request, Response, get

from semcache.ledger import LedgerUnavailable, UsageLedger, utc_day
from semcache.ledger.records import FLOAT_FIELDS, INT_FIELDS, KEY_FIELDS, SUM_FIELDS
from server.apidoc.operation import SERVER_ERROR, Answer, Field, RouteDoc, documented
from server.envelope.context import record
from server.errors import ApiError

DEFAULT_GROUP_BY = "tenant,model,day"


USAGE_PAGE = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "description": "One group: the fields grouped by, then every sum.",
                "required": list(SUM_FIELDS),
                "properties": {
                    **{f: {"type": "string"} for f in KEY_FIELDS},
                    **{f: {"type": "integer"} for f in INT_FIELDS},
                    **{f: {"type": "number"} for f in FLOAT_FIELDS},
                },
            },
        },
    },
}
DAY = {"type": "string", "description": "A UTC day, `YYYY-MM-DD`."}


@get(
    "/v1/usage",
    operation_class=documented(
        RouteDoc(
            summary="Usage and cost, grouped",
            tag="Usage",
            description="A token sees its own tenant's rows; an admin's sees every tenant's.",
            query=(
                Field("start", DAY, "First day (included); default the 1st of this month."),
                Field("end", DAY, "Last day (included); default today."),
                Field(
                    "group_by",
                    {"type": "string"},
                    "Comma-separated: any of " + ", ".join(KEY_FIELDS) + "; empty: one total.",
                ),
                Field("tenant", {"type": "string"}, "Admin only: one tenant's rows."),
            ),
            answers=(Answer(200, USAGE_PAGE, "One row per group, sorted by group."),),
            errors=(400, 401, 403, 429, *SERVER_ERROR, 503),
        )
    ),
)
async def usage(request: Request[Any, Any, Any]) -> Response[bytes]:
    principal = record(request).principal
    query = request.query_params
    today = utc_day(time.time())
    start = query.get("start") or today[:8] + "01"
    end = query.get("end") or today
    raw_group_by = query.get("group_by", DEFAULT_GROUP_BY)
    group_by = [g.strip() for g in raw_group_by.split(",") if g.strip()]
    tenant = query.get("tenant") or None
    if not principal.admin:
        if tenant is not None and tenant != principal.tenant:
            raise ApiError(
                403, "A token sees its own tenant's usage only.", param="tenant", code="forbidden"
            )
        tenant = principal.tenant
    ledger: UsageLedger = request.app.state.ledger
    try:
        rows = await ledger.query(start, end, group_by, tenant)
    except ValueError as exc:
        param = str(exc).partition(":")[0]
        raise ApiError(
            400,
            str(exc),
            param=param if param in ("start", "end", "group_by") else None,
            code="invalid_value",
        ) from None
    except LedgerUnavailable as exc:
        raise ApiError(
            503,
            f"The usage ledger cannot be read now: {exc}",
            code="ledger_unavailable",
            retry_after_s=1,
        ) from None
    return Response(orjson.dumps({"object": "list", "data": rows}), media_type="application/json")


ROUTES = [usage]
