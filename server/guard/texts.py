"""Where the text is in a request body and in an answer, per route: read it, and write
redacted text back into a copy (the client's body is never changed in place)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

Slot = tuple[Any, Any]
"""A container and the key (or index) of one string in it."""


def _content_slots(message: Any, out: list[Slot]) -> None:
    if not isinstance(message, dict):
        return
    content = message.get("content")
    if isinstance(content, str):
        out.append((message, "content"))
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append((part, "text"))


def prompt_slots(route: str, body: dict[str, Any]) -> list[Slot]:
    """Every string of the prompt: chat messages (and their text parts), a completion's
    prompt(s), a response's instructions and input, pooling inputs."""
    out: list[Slot] = []
    if route == "chat":
        for message in body.get("messages") or ():
            _content_slots(message, out)
    elif route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            out.append((body, "prompt"))
        elif isinstance(prompt, list):
            out += [(prompt, i) for i, p in enumerate(prompt) if isinstance(p, str)]
    elif route == "responses":
        if isinstance(body.get("instructions"), str):
            out.append((body, "instructions"))
        items = body.get("input")
        if isinstance(items, str):
            out.append((body, "input"))
        elif isinstance(items, list):
            for item in items:
                _content_slots(item, out)
    else:  # embeddings, classification
        items = body.get("input")
        if isinstance(items, str):
            out.append((body, "input"))
        elif isinstance(items, list):
            out += [(items, i) for i, p in enumerate(items) if isinstance(p, str)]
    return out


def answer_slots(route: str, answer: dict[str, Any]) -> list[Slot]:
    """Every string of a whole (non-streamed) answer the client reads."""
    out: list[Slot] = []
    if route == "responses":
        for item in answer.get("output") or ():
            if isinstance(item, dict):
                for part in item.get("content") or ():
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        out.append((part, "text"))
        return out
    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str):
            out.append((choice, "text"))
        message = choice.get("message")
        if isinstance(message, dict):
            for field in ("content", "reasoning_content", "reasoning"):
                if isinstance(message.get(field), str):
                    out.append((message, field))
    return out


def rewrite(
    body: dict[str, Any], slots: Callable[[dict[str, Any]], list[Slot]], new: list[str]
) -> dict[str, Any]:
    """A deep copy of ``body`` whose slots (as ``slots`` finds them) hold ``new``."""
    out = copy.deepcopy(body)
    for (container, key), text in zip(slots(out), new, strict=True):
        container[key] = text
    return out
