"""``semcache keys``: a running gateway's API keys through its admin API (``/admin/keys``).

``create`` and ``rotate`` print the secret once, on a line of its own after the key; the
other commands print the key (``--json``: as the API answers).
"""

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
from server.limits.settings import LimitSettings

LIST_COLUMNS = ("id", "tenant", "name", "status", "models", "expires", "last used")


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(seconds))


def format_keys(keys: Sequence[dict[str, Any]]) -> str:
    """``GET /admin/keys`` as a text table."""
    rows = [list(LIST_COLUMNS)]
    for k in keys:
        models = k.get("models")
        rows.append(
            [
                k["id"],
                k["tenant"],
                k["name"],
                k["status"],
                "*" if models is None else ",".join(models),
                _when(k.get("expires_at")),
                _when(k.get("last_used_at")),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(LIST_COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def pairs(values: Sequence[str] | None, what: str) -> dict[str, str]:
    """``KEY=VALUE`` options as a dict (argparse.ArgumentTypeError naming a bad one)."""
    out: dict[str, str] = {}
    for item in values or ():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{what} must be KEY=VALUE, not {item!r}")
        out[name] = value
    return out


def limits_of(values: Sequence[str] | None) -> dict[str, Any] | None:
    """``--limit requests_per_minute=60`` options as a ``limits`` object (checked here)."""
    given = pairs(values, "--limit")
    if not given:
        return None
    try:
        limits = msgspec.convert(given, LimitSettings, strict=False)
    except msgspec.ValidationError as exc:
        raise argparse.ArgumentTypeError(f"--limit: {exc}") from None
    return {k: v for k, v in msgspec.to_builtins(limits).items() if v is not None}


def fields_of(args: argparse.Namespace, *, creating: bool) -> dict[str, Any]:
    """The JSON body of ``create`` or ``update`` from the options given."""
    body: dict[str, Any] = {}
    if creating:
        body["tenant"] = args.tenant
    if args.name is not None:
        body["name"] = args.name
    if args.role is not None:
        body["roles"] = args.role
    if args.model is not None:
        body["models"] = args.model
    if args.any_model:
        body["models"] = None
    if args.expires_in is not None:
        body["expires_at"] = time.time() + args.expires_in
    if args.expires_at is not None:
        body["expires_at"] = args.expires_at
    if args.no_expiry:
        body["expires_at"] = None
    if (limits := limits_of(args.limit)) is not None:
        body["limits"] = limits
    if args.meta is not None:
        body["metadata"] = pairs(args.meta, "--meta")
    return body


class AdminApiError(Exception):
    """The gateway could not be reached, or answered something but 200."""


def request(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    """One call to the admin API; AdminApiError unless it answers 200."""
    try:
        r = httpx.request(
            method,
            f"{args.url.rstrip('/')}{path}",
            json=body,
            params={"tenant": args.tenant}
            if method == "GET" and getattr(args, "tenant", None)
            else None,
            headers=bearer(args, f"keys {args.action}"),
            timeout=30,
        )
    except httpx.HTTPError as exc:
        raise AdminApiError(f"cannot reach {args.url}: {exc}") from None
    if r.status_code != 200:
        raise AdminApiError(refusal(r, args.url))
    return r.json()


def show(value: Any, args: argparse.Namespace) -> None:
    if args.json or not isinstance(value, dict) or "secret" not in value:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")
        return
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value["key"])).decode() + "\n")
    print(f"secret (shown once): {value['secret']}")


def cmd_keys(args: argparse.Namespace) -> int:
    try:
        match args.action:
            case "create":
                show(request(args, "POST", "/admin/keys", fields_of(args, creating=True)), args)
            case "list":
                keys = request(args, "GET", "/admin/keys")["data"]
                if args.json:
                    show(keys, args)
                else:
                    print(format_keys(keys) if keys else "no API keys")
            case "show":
                show(request(args, "GET", f"/admin/keys/{args.id}"), args)
            case "update":
                body = fields_of(args, creating=False)
                show(request(args, "PATCH", f"/admin/keys/{args.id}", body), args)
            case "rotate":
                body = {"grace_s": args.grace}
                show(request(args, "POST", f"/admin/keys/{args.id}/rotate", body), args)
            case "revoke":
                show(request(args, "DELETE", f"/admin/keys/{args.id}"), args)
    except argparse.ArgumentTypeError as exc:
        print(f"semcache: {exc}", file=sys.stderr)
        return 2
    except NoToken as exc:
        return say_no_token(exc)
    except AdminApiError as exc:
        print(f"semcache: {exc}", file=sys.stderr)
        return 1
    return 0


def _key_fields(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    parser.add_argument("--name", help="how logs, limits and lists name the key")
    parser.add_argument("--role", action="append", choices=["admin"], help="a role (repeat)")
    parser.add_argument("--model", action="append", help="a model id or alias it may use (repeat)")
    parser.add_argument("--expires-in", type=float, metavar="SECONDS", help="expiry from now")
    parser.add_argument("--expires-at", type=float, metavar="EPOCH_S", help="expiry, epoch seconds")
    parser.add_argument(
        "--limit", action="append", metavar="FIELD=VALUE", help="a limit or budget (repeat)"
    )
    parser.add_argument("--meta", action="append", metavar="KEY=VALUE", help="metadata (repeat)")
    if creating:
        parser.set_defaults(any_model=False, no_expiry=False)
    else:
        parser.add_argument("--any-model", action="store_true", help="lift the model scope")
        parser.add_argument("--no-expiry", action="store_true", help="remove the expiry")


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = commands.add_parser(
        "keys",
        help="API keys of a running gateway: create, list, show, update, rotate, revoke",
        description="API keys through a gateway's admin API (an admin token). The secret of "
        "a key is printed once, by create and rotate.",
    )
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="a new key of a tenant; prints its secret once")
    create.add_argument("--tenant", required=True)
    _key_fields(create, creating=True)
    listing = actions.add_parser("list", help="every key (revoked ones too)")
    listing.add_argument("--tenant", help="only this tenant's keys")
    show_one = actions.add_parser("show", help="one key")
    update = actions.add_parser("update", help="change a key's scope, expiry, limits, metadata")
    _key_fields(update, creating=False)
    rotate = actions.add_parser("rotate", help="a new secret; the old one valid for --grace")
    rotate.add_argument("--grace", type=float, default=0.0, metavar="SECONDS")
    revoke = actions.add_parser("revoke", help="refused on every gateway within a second")
    for parser in (show_one, update, rotate, revoke):
        parser.add_argument("id", help="the key's id (the part after sk-sc- in its secret)")
    for parser in (create, listing, show_one, update, rotate, revoke):
        parser.add_argument("--json", action="store_true", help="print the API's JSON")
        env_option(parser, "--url", default="http://127.0.0.1:8080")
        env_option(parser, "--token", help="an admin token")
        parser.set_defaults(func=cmd_keys)
