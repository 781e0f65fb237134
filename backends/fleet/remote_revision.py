"""A revision for a model served by vLLM servers the gateway cannot read the files of.

What a server reports of itself stands in for a hash of the files: the ``root`` (the folder
or hub id it loaded) and ``max_model_len`` of the served model in ``/v1/models``, and vLLM's
``/version``. A server restarted on other weights under the same served name reports another
root, so the revision, and with it every cache key of the model, changes. The health checks
re-read it (``backends.fleet.health``); a config that pins ``revision`` skips all of this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson

from backends.upstream import HTTP_ERRORS

REMOTE_PREFIX = "remote:"


async def _get_json(session: aiohttp.ClientSession, url: str, limit: aiohttp.ClientTimeout) -> Any:
    async with session.get(url, timeout=limit) as response:
        body = await response.read()
        return orjson.loads(body) if response.status == 200 else None


async def reported_identity(
    session: aiohttp.ClientSession,
    url: str,
    served_model: str,
    limit: aiohttp.ClientTimeout,
) -> str | None:
    """What the server at ``url`` reports of ``served_model`` (JSON text), or ``None`` when it
    does not answer or does not serve it."""
    try:
        models = await _get_json(session, f"{url}/v1/models", limit)
        version = await _get_json(session, f"{url}/version", limit)
    except (*HTTP_ERRORS, orjson.JSONDecodeError):
        return None
    data = models.get("data") if isinstance(models, dict) else None
    entry = next(
        (m for m in data or [] if isinstance(m, dict) and m.get("id") == served_model), None
    )
    if entry is None:
        return None
    release = version.get("version") if isinstance(version, dict) else None
    return orjson.dumps([entry.get("root"), entry.get("max_model_len"), release]).decode()


def remote_revision(identities: Iterable[str]) -> str:
    """One revision for what a backend's servers report (several during a rolling swap: a
    revision of its own, so no answer of either model is served for the other)."""
    digest = hashlib.blake2b(digest_size=8)
    for identity in sorted(set(identities)):
        digest.update(identity.encode())
        digest.update(b"\0")
    return REMOTE_PREFIX + digest.hexdigest()
