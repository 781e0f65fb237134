"""``semcache usage``: a running gateway's usage ledger (``GET /v1/usage``) as a text table."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from server.cli.gateway_auth import NoToken, bearer, refusal, say_no_token
from server.cli.options import env_option

USAGE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("requests", "requests"),
    ("prompt_tokens", "prompt"),
    ("completion_tokens", "completion"),
    ("exact_hits", "exact"),
    ("semantic_hits", "semantic"),
    ("tokens_saved", "tok saved"),
    ("cost_usd", "cost $"),
    ("saved_usd", "saved $"),
)
USAGE_KEYS = ("tenant", "model", "route", "day")


def format_usage(rows: Sequence[dict[str, Any]]) -> str:
    """``/v1/usage`` rows as a text table, with a total line when there are several."""
    keys = [k for k in USAGE_KEYS if rows and k in rows[0]]
    lines: list[list[str]] = [[*keys, *(title for _, title in USAGE_COLUMNS)]]

    def cells(row: dict[str, Any]) -> list[str]:
        return [
            f"{row.get(f, 0):.6f}" if f.endswith("_usd") else f"{row.get(f, 0):,}"
            for f, _ in USAGE_COLUMNS
        ]

    for row in rows:
        lines.append([str(row[k]) for k in keys] + cells(row))
    if len(rows) > 1:
        total = {f: sum(r.get(f, 0) for r in rows) for f, _ in USAGE_COLUMNS}
        lines.append(["total" if i == 0 else "" for i in range(len(keys))] + cells(total))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < len(keys) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )


TENANT_OR_ADMIN = "a tenant's token shows its own usage, an admin's every tenant's"


def cmd_usage(args: argparse.Namespace) -> int:
    try:
        headers = bearer(args, "usage", TENANT_OR_ADMIN)
    except NoToken as exc:
        return say_no_token(exc)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    params = {
        "start": args.start or today[:8] + "01",
        "end": args.end or today,
        "group_by": args.group_by,
    }
    if args.tenant:
        params["tenant"] = args.tenant
    try:
        r = httpx.get(
            f"{args.url.rstrip('/')}/v1/usage",
            params=params,
            headers=headers,
            timeout=30,
        )
    except httpx.HTTPError as exc:
        print(f"semcache: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"semcache: {refusal(r, args.url)}", file=sys.stderr)
        return 1
    rows = r.json()["data"]
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(rows)).decode() + "\n")
    elif rows:
        print(format_usage(rows))
    else:
        print(f"no usage from {params['start']} to {params['end']}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage = commands.add_parser(
        "usage",
        help="requests, tokens and USD used and saved, from a running gateway's ledger",
        description="A table of the usage ledger (GET /v1/usage): a tenant's token sees "
        "its own usage, an admin's every tenant's. Days are UTC.",
    )
    usage.add_argument("--start", help="first day, YYYY-MM-DD (default: the 1st of this month)")
    usage.add_argument("--end", help="last day, YYYY-MM-DD (default: today)")
    usage.add_argument(
        "--group-by",
        default="tenant,model,day",
        help="comma-separated: any of tenant, model, route, day; empty: one total "
        "(default: tenant,model,day)",
    )
    usage.add_argument("--tenant", help="only this tenant (an admin's token)")
    usage.add_argument("--json", action="store_true", help="print the rows as JSON")
    env_option(usage, "--url", default="http://127.0.0.1:8080")
    env_option(usage, "--token", help="bearer token: " + TENANT_OR_ADMIN)
    usage.set_defaults(func=cmd_usage)
