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
    prompt(s), a response's instructions and input, a tokenization's prompt or messages,
    pooling and scoring inputs (``input``)."""
    out: list[Slot] = []
    if route in ("chat", "tokenize"):
        for message in body.get("messages") or ():
            _content_slots(message, out)
    if route in ("completions", "tokenize"):
        _strings(body, "prompt", out)
    if route == "responses":
        if isinstance(body.get("instructions"), str):
            out.append((body, "instructions"))
        items = body.get("input")
        if isinstance(items, str):
            out.append((body, "input"))
        elif isinstance(items, list):
            for item in items:
                _content_slots(item, out)
    if route not in ("chat", "tokenize", "completions", "responses"):
        _strings(body, "input", out)  # embeddings, classification, rerank
    return out


def _strings(body: dict[str, Any], key: str, out: list[Slot]) -> None:
    """``body[key]`` when it is a string, or each string of it when it is a list."""
    value = body.get(key)
    if isinstance(value, str):
        out.append((body, key))
    elif isinstance(value, list):
        out += [(value, i) for i, p in enumerate(value) if isinstance(p, str)]


def answer_slots(route: str, answer: dict[str, Any]) -> list[Slot]:
    """Every string of a whole (non-streamed) answer the client reads."""
    out: list[Slot] = []
    if route == "detokenize":
        return [(answer, "prompt")] if isinstance(answer.get("prompt"), str) else []
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
