"""A stored answer made to look newly made: fresh ids and creation times.

Under a sharing rule that hides hits (``CacheRule.reveal``), a tenant served another
request's answer must not learn from the body what the headers do not say: an OpenAI answer
carries its ``id`` and ``created`` time (the Responses API its ``created_at``, also inside
each event's ``response``), which would show that the answer is older than the request, or
the same one another request got. :func:`restamped` gives every id a new random value of the
same form (one new value per old one, so a stream's chunks still agree) and every creation
time the present. Streams are OpenAI events; JSON answers OpenAI objects; anything else (a
pooling item's raw payload) is left as it is.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
import orjson

from semcache.entry import JSON, CachedAnswer

_TIMES = ("created", "created_at")


def _new_id(old: str) -> str:
    """A random id of ``old``'s form: its prefix (``chatcmpl-``, ``resp_``) and length."""
    cut = max(old.rfind("-"), old.rfind("_")) + 1
    tail = len(old) - cut
    return old[:cut] + secrets.token_hex((tail + 1) // 2)[:tail]


def _stamp(doc: dict[str, Any], now: int, ids: dict[str, str]) -> None:
    old = doc.get("id")
    if isinstance(old, str) and old:
        doc["id"] = ids.setdefault(old, _new_id(old))
    for name in _TIMES:
        if isinstance(doc.get(name), int | float) and not isinstance(doc.get(name), bool):
            doc[name] = now
    inner = doc.get("response")
    if isinstance(inner, dict):
        _stamp(inner, now, ids)


def _json(data: bytes, now: int, ids: dict[str, str]) -> bytes:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(doc, dict):
        return data
    _stamp(doc, now, ids)
    return orjson.dumps(doc)


def _chunk(chunk: bytes, now: int, ids: dict[str, str]) -> bytes:
    if not chunk.startswith(b"event:"):
        return _json(chunk, now, ids)
    # a Responses API event block: its ``data:`` line restamped, every other byte kept
    lines = chunk.split(b"\n")
    for n, line in enumerate(lines):
        if line.startswith(b"data:"):
            lines[n] = b"data: " + _json(line[5:].lstrip(b" "), now, ids)
    return b"\n".join(lines)


def restamped(answer: CachedAnswer, now: float) -> CachedAnswer:
    """``answer`` with new ids and ``now`` as its creation time (see the module doc)."""
    if answer.chunks is None and answer.content_type != JSON:
        return answer  # not an OpenAI object: a pooling item's raw payload
    ids: dict[str, str] = {}
    stamp = int(now)
    if answer.chunks is not None:
        chunks = [_chunk(c, stamp, ids) for c in answer.chunks]
        return msgspec.structs.replace(answer, chunks=chunks)
    if answer.body is not None:
        return msgspec.structs.replace(answer, body=_json(answer.body, stamp, ids))
    return answer
