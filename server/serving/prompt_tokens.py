"""A generation request's prompt tokens, as vLLM's ``/tokenize`` counts them (its chat
template and tools included): what the errors of a request past the context say. Asked only
then, so never cached; ``/tokenize`` counts a prompt of any length."""

from __future__ import annotations

from typing import Any, Final

import orjson

from backends.interfaces import BackendError
from server.serving.call import GenerationCall

CHAT_FIELDS: Final = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
)
"""The fields of a chat request that vLLM's ``/tokenize`` takes (they shape the prompt)."""


def tokenize_body(route: str, upstream: dict[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` body that renders ``upstream``'s prompt; ``None`` where the route's
    prompt is not one ``/tokenize`` takes (the Responses API's input, a list of prompts)."""
    if route == "chat" and isinstance(upstream.get("messages"), list):
        fields = {k: upstream[k] for k in CHAT_FIELDS if upstream.get(k) is not None}
        return {"model": upstream["model"], **fields}
    if route == "completions" and isinstance(upstream.get("prompt"), str):
        return {"model": upstream["model"], "prompt": upstream["prompt"]}
    return None


async def count_prompt(call: GenerationCall) -> int | None:
    """The prompt's tokens of ``call``; ``None`` when they cannot be counted."""
    body = tokenize_body(call.route, call.upstream)
    if body is None:
        return None
    try:
        resp = await call.backend.post("/tokenize", body, call.ctx)
    except BackendError:
        return None
    if resp.status != 200:
        return None
    try:
        count = orjson.loads(resp.body).get("count")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return count if isinstance(count, int) else None
