"""``semcache cache purge``: purge a running gateway's cache entries through its admin API."""

from __future__ import annotations

import argparse
import sys

import httpx

from server.cli.gateway_auth import NoToken, bearer, refusal, say_no_token
from server.cli.options import env_option


def cmd_cache_purge(args: argparse.Namespace) -> int:
    try:
        headers = bearer(args, "cache purge")
    except NoToken as exc:
        return say_no_token(exc)
    body = {"kind": args.kind, "target": args.target or ""}
    try:
        r = httpx.post(
            f"{args.url.rstrip('/')}/admin/cache/purge", json=body, headers=headers, timeout=30
        )
    except httpx.HTTPError as exc:
        print(f"semcache: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"semcache: {refusal(r, args.url)}", file=sys.stderr)
        return 1
    print(r.text)
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = commands.add_parser("cache", help="the cache of a running gateway").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    purge = cache.add_parser("purge", help="purge entries through the admin API")
    purge.add_argument("kind", choices=["key", "model", "tenant", "scope", "tag", "all"])
    purge.add_argument("target", nargs="?", default="")
    env_option(purge, "--url", default="http://127.0.0.1:8080")
    env_option(purge, "--token", help="an admin token")
    purge.set_defaults(func=cmd_cache_purge)
