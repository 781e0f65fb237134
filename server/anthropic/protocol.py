"""Anthropic's Messages API: the request fields the gateway reads, and the answers' shapes.

Unknown fields are accepted and ignored, as unknown content block types are not: a block the
gateway cannot hand to the model (``document``, a server tool's result, …) is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from foundation.config_types import NonEmptyStr, PosInt

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class TextBlock(msgspec.Struct, tag="text", kw_only=True):
    text: str


class ImageBlock(msgspec.Struct, tag="image", kw_only=True):
    source: dict[str, Any]


class ToolUseBlock(msgspec.Struct, tag="tool_use", kw_only=True):
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolResultBlock(msgspec.Struct, tag="tool_result", kw_only=True):
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", kw_only=True):
    data: str = ""


ContentBlock = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    """``system`` turns inside the conversation (Claude Code sends reminders so): kept in place."""
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    """A client tool (the model calls it, the client runs it). Server tools (``web_search``
    and the like, which carry a ``type`` and no schema) are not offered: a 400."""

    name: NonEmptyStr
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None


class TokenCountRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model: NonEmptyStr
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    """Accepted; the models served here do not think apart from their answer."""


class MessagesRequest(TokenCountRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: PosInt
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    metadata: Metadata | None = None
    stream: bool | None = None


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class MessageAnswer(msgspec.Struct, kw_only=True):
    """The answer as documented: a ``message`` object (with ``stream: true``, its events)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int
