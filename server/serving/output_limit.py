"""The policy's ``max_tokens`` default and cap applied to a generation request, and said in
its answer's usage.

A request that names no limit gets the rule's default; one that asks more than the cap gets
the cap; one inside the cap is sent as it is. When the gateway set the value, the answer's
``usage`` says so (``max_tokens_applied``, ``max_tokens_source``: ``default`` or ``cap``): in
a JSON answer, in a stream's usage chunk (chat, completions) or its terminal event's
``response.usage`` (responses). The note is part of the answer the cache stores, and of its
key, so a replay says what its request was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from foundation.sse import TERMINAL_EVENTS, parse_block
from semcache.max_tokens import Applied, MaxTokens

FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
}
"""Per route, the body fields that bound the answer's length (the first present wins, as in
vLLM); the last is the one set when the request names none."""

NOTE_KEYS: Final = ("max_tokens_applied", "max_tokens_source")
"""The usage fields that say what the gateway applied (Workers AI's usage carries them too)."""


def limit_output(
    route: str, body: dict[str, Any], rule: MaxTokens, fallback: int | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``body`` with the rule's default or cap applied, and the usage note (``None``: the
    request's own value stands, or the route has no such field). ``fallback``: the default
    when the rule has none (Workers AI's own, 256)."""
    names = FIELDS.get(route)
    if names is None:
        return body, None
    present = [n for n in names if isinstance(body.get(n), int)]
    asked = body[present[0]] if present else None
    applied = rule.applied(asked)
    if applied is None and asked is None and fallback:
        applied = Applied(fallback, "default")
    if applied is None:
        return body, None
    limited = {**body, **{name: applied.value for name in present or names[-1:]}}
    return limited, {NOTE_KEYS[0]: applied.value, NOTE_KEYS[1]: applied.source}


def _with_note(usage: Any, note: Mapping[str, Any]) -> bool:
    if not isinstance(usage, dict):
        return False
    usage.update(note)
    return True


def noted_json(body: bytes, note: Mapping[str, Any] | None) -> bytes:
    """A JSON answer with the note in its ``usage`` (unchanged without a note or a usage)."""
    if note is None or b'"usage"' not in body:
        return body
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(doc, dict) or not _with_note(doc.get("usage"), note):
        return body
    return orjson.dumps(doc)


def noted_item(item: bytes, note: Mapping[str, Any] | None) -> bytes:
    """One stream item (a ``data:`` payload, or a Responses API event block) with the note
    in the usage that ends the answer: the usage-only chunk, or the terminal event's."""
    if note is None or b'"usage"' not in item:
        return item
    name, payload = parse_block(item) if item[:6] == b"event:" else (None, item)
    if payload is None or (name is not None and name not in TERMINAL_EVENTS):
        return item
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return item
    if not isinstance(doc, dict):
        return item
    if name is not None:
        response = doc.get("response")
        noted = isinstance(response, dict) and _with_note(response.get("usage"), note)
    else:
        noted = not doc.get("choices") and _with_note(doc.get("usage"), note)
    if not noted:
        return item
    data = orjson.dumps(doc)
    return data if name is None else b"event: " + name + b"\ndata: " + data
