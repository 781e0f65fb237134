"""The bearer token of the commands that call a running gateway (purge, usage, keys,
backends scale), and its refusals said plainly: without a token they stop before calling,
saying how to give one, instead of failing on an empty ``Authorization`` header."""

from __future__ import annotations

import argparse
import sys

import httpx
import orjson

from server.cli.options import env_default

ADMIN_TOKEN = (
    'an admin token: a config token with roles = ["admin"], an API key with the admin '
    "role, or the admin token ([auth.admin])"
)


class NoToken(Exception):
    """A command that calls a gateway was given no token."""


def bearer(args: argparse.Namespace, command: str, what: str = ADMIN_TOKEN) -> dict[str, str]:
    """The ``Authorization`` header of ``args.token``; :class:`NoToken`, naming ``command``,
    the options that give one and ``what`` token it takes, when there is none."""
    token = (args.token or "").strip()
    if not token:
        variable = env_default("--token").variable
        raise NoToken(
            f"`semcache {command}` needs a token ({what}): give it with --token TOKEN or in "
            f"the environment variable {variable}"
        )
    return {"authorization": f"Bearer {token}"}


def refusal(answer: httpx.Response, url: str) -> str:
    """What a gateway's non-200 answer says, with what to do about a refused token."""
    message = answer.text
    try:
        doc = orjson.loads(answer.content)
        message = doc["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    if answer.status_code == 401:
        return f"{url} refused the token (401): {message}"
    if answer.status_code == 403:
        return f"{url} refused the token, which lacks the admin role (403): {message}"
    return f"{url} answered {answer.status_code}: {message}"


def say_no_token(exc: NoToken) -> int:
    """Print ``exc`` and return the exit status of a usage error."""
    print(f"semcache: {exc}", file=sys.stderr)
    return 2
