"""Semantic caching of chat answers: which requests qualify, their partition and query text.

Only single-turn requests (system/developer messages plus one user message with text
content) at temperature 0 qualify; the user message is the text searched. Everything else
in the body — system prompt, sampling and length parameters, tools, response format — goes
into the partition (a hash of the body with the user text blanked), so a hit can only come
from a request that differs in the user's words alone. The cached answer is then read by
the digest the matched record holds (the exact entry stored beside it), checked against the
request's scope, model and revision and the current purge epochs like any exact lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from semcache.cache_keys import CacheKey, canonical_request, params_hash
from semcache.semantic.cache import SemanticCache
from semcache.semantic.records import PartitionKey

_CONTEXT_ROLES = frozenset({"system", "developer"})


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) == 1:
        part = content[0]
        if (
            isinstance(part, Mapping)
            and part.get("type") == "text"
            and set(part)
            <= {
                "type",
                "text",
            }
        ):
            text = part.get("text")
            return text if isinstance(text, str) else None
    return None


def chat_query(body: Mapping[str, Any]) -> tuple[int, str] | None:
    """(message index, user text) of a request that may use the semantic cache, else None."""
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return None
    if temperature != 0 or body.get("n", 1) not in (1, None):
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    found: tuple[int, str] | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return None
        role = message.get("role")
        if role in _CONTEXT_ROLES:
            continue
        if role != "user" or found is not None:
            return None  # multi-turn, tools, assistant prefill: exact cache only
        text = _text_of(message.get("content"))
        if not text or set(message) - {"role", "content", "name"}:
            return None
        found = (i, text)
    return found


def with_query(body: Mapping[str, Any], index: int, text: str) -> dict[str, Any]:
    """The body with the user message at ``index`` replaced by ``text``."""
    messages = list(body["messages"])
    messages[index] = {**messages[index], "content": text}
    return {**body, "messages": messages}


def chat_partition(
    semantic: SemanticCache, key: CacheKey, body: Mapping[str, Any], index: int
) -> PartitionKey:
    """Partition of a qualifying chat request (see module docstring)."""
    rest = params_hash(canonical_request("chat", with_query(body, index, "")))
    epochs = ".".join(str(e) for e in key.epochs)
    return semantic.partition_key(
        scope=key.scope,
        model_revision=f"{key.model_id}@{key.revision}",
        task="chat",
        template=f"{key.template_fp}/{rest[:16]}/e{epochs}",
    )
