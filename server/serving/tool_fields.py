"""``tools: []`` read as no tools, in the OpenAI-shaped bodies of chat and Responses requests.

Clients send an empty list to mean "no tools" (Claude Code with ``--tools ""``), which vLLM
refuses. Without tools, ``tool_choice`` ``auto`` or ``none`` and ``parallel_tool_calls`` say
nothing and go too, so such a request is keyed, and answered, as one that named no tools; a
``tool_choice`` that asks for a tool (``required``, a named tool) cannot be met: a 400.
"""

from __future__ import annotations

from typing import Any, Final

from server.errors import ApiError

TOOL_ROUTES: Final = frozenset({"chat", "responses"})
"""The cache routes whose bodies carry OpenAI's ``tools`` and ``tool_choice``."""

_IDLE_CHOICES: Final = frozenset({"auto", "none"})


def without_empty_tools(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a request without tools when it names none (``tools`` absent, null or
    empty); otherwise ``body`` itself."""
    if body.get("tools"):
        return body
    if not any(name in body for name in ("tools", "tool_choice", "parallel_tool_calls")):
        return body
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, str) and choice in _IDLE_CHOICES):
        raise ApiError(
            400,
            "`tool_choice` asks for a tool but the request names no `tools`.",
            param="tool_choice",
            code="invalid_value",
        )
    return {
        name: value
        for name, value in body.items()
        if name not in ("tools", "tool_choice", "parallel_tool_calls")
    }
