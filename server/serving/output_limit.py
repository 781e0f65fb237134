"""The policy's ``max_tokens`` default and cap applied to a generation request, and said in
its answer's usage.

A request that names no limit gets the rule's default; one that asks more than the cap gets
the cap; one inside the cap is sent as it is. When the gateway set the value, the answer's
``usage`` says so (``max_tokens_applied``, ``max_tokens_source``: ``default`` or ``cap``): in
a JSON answer, in a stream's usage chunk (chat, completions) or its terminal event's
``response.usage`` (responses). The note is part of the answer the cache stores, and of its
key, so a replay says what its request was given.

The gateway's bound is a ceiling, never a cause of refusal: one past the model's context is
lowered to the context before it is sent (vLLM refuses a ``max_tokens`` above
``max_model_len``, and lowers one that only goes past what the prompt leaves), and when the
prompt left less than the bound the note says what the context left (``max_tokens_source``:
``context``), from the answer's prompt tokens. A surface whose own ``max_tokens`` is a
ceiling (Workers AI) has the request's value treated the same way; on OpenAI's and
Anthropic's routes a request's own value goes to vLLM as it is, and one past the context is
refused in the route's words before it is sent (``context_limit``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, NamedTuple

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


class OutputLimit(NamedTuple):
    """What bounds a request's answer: the note of what the gateway applied (``None``: the
    request's own value), the bound sent where the context may lower it, and the model's
    context length (``None``: unknown)."""

    note: dict[str, Any] | None = None
    sent: int | None = None
    context: int | None = None

    def said(self, usage: Mapping[str, Any]) -> dict[str, Any] | None:
        """The note for an answer with this ``usage``: what the context left when the prompt
        left less than the bound sent."""
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        if self.sent is not None and self.context and type(prompt) is int:
            room = self.context - prompt
            if 0 < room < self.sent:
                return {NOTE_KEYS[0]: room, NOTE_KEYS[1]: "context"}
        return self.note


NO_LIMIT: Final = OutputLimit()


def asked(route: str, body: dict[str, Any]) -> tuple[str, int] | None:
    """The field that bounds ``body``'s answer and its value, if the body names one."""
    for name in FIELDS.get(route, ()):
        value = body.get(name)
        if isinstance(value, int):
            return name, value
    return None


def limit_output(
    route: str,
    body: dict[str, Any],
    rule: MaxTokens,
    fallback: int | None = None,
    *,
    context: int | None = None,
    ceiling: bool = False,
) -> tuple[dict[str, Any], OutputLimit]:
    """``body`` with the rule's default or cap applied, and what bounds its answer.
    ``fallback``: the default when the rule has none (Workers AI's own, 256); ``context``:
    the model's context length; ``ceiling``: the request's own value is a ceiling too."""
    names = FIELDS.get(route)
    if names is None:
        return body, NO_LIMIT
    present = [n for n in names if isinstance(body.get(n), int)]
    asked = body[present[0]] if present else None
    applied = rule.applied(asked)
    if applied is None and asked is None and fallback:
        applied = Applied(fallback, "default")
    if applied is not None:
        note: dict[str, Any] | None = {NOTE_KEYS[0]: applied.value, NOTE_KEYS[1]: applied.source}
        value = applied.value
    elif ceiling and asked is not None:
        note, value = None, asked
    else:
        return body, NO_LIMIT
    if context and value > context:
        value = context
    if value != asked:
        body = {**body, **{name: value for name in present or names[-1:]}}
    return body, OutputLimit(note, value, context)


def _with_note(usage: Any, limit: OutputLimit) -> bool:
    if not isinstance(usage, dict):
        return False
    note = limit.said(usage)
    if note is None:
        return False
    usage.update(note)
    return True


def noted_json(body: bytes, limit: OutputLimit) -> bytes:
    """A JSON answer with the note in its ``usage`` (unchanged without a note or a usage)."""
    if limit.sent is None or b'"usage"' not in body:
        return body
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(doc, dict) or not _with_note(doc.get("usage"), limit):
        return body
    return orjson.dumps(doc)


def noted_item(item: bytes, limit: OutputLimit) -> bytes:
    """One stream item (a ``data:`` payload, or a Responses API event block) with the note
    in the usage that ends the answer: the usage-only chunk, or the terminal event's."""
    if limit.sent is None or b'"usage"' not in item:
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
        noted = isinstance(response, dict) and _with_note(response.get("usage"), limit)
    else:
        noted = not doc.get("choices") and _with_note(doc.get("usage"), limit)
    if not noted:
        return item
    data = orjson.dumps(doc)
    return data if name is None else b"event: " + name + b"\ndata: " + data
