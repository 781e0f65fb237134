"""The requests every target gets: one chat request (non-stream and stream) and one
embeddings request, with the same headers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import orjson

from bench.lib.support import GATEWAY_EMBEDDINGS_ID, GATEWAY_MODEL_ID

MASTER_KEY = "sk-bench-exact-hit-0123456789abcdef"
"""LiteLLM's proxy refuses to start without one; loopback only. All targets get the header."""
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]

Kind = Literal["json", "sse", "embeddings"]
"""A chat request answered as JSON, the same request streamed (SSE replay), an embeddings
request (float vectors, JSON)."""
KINDS: tuple[Kind, ...] = get_args(Kind)
CHAT_KINDS: tuple[Kind, ...] = ("json", "sse")
KIND_LABEL: dict[Kind, str] = {"json": "non-stream", "sse": "stream", "embeddings": "embeddings"}
PATHS: dict[Kind, str] = {
    "json": "/v1/chat/completions",
    "sse": "/v1/chat/completions",
    "embeddings": "/v1/embeddings",
}


def request_body(stream: bool) -> bytes:
    """The one chat request every target gets (LiteLLM's model name is the gateway's)."""
    body: dict[str, Any] = {
        "model": GATEWAY_MODEL_ID,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 48,
    }
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


EMBEDDINGS_INPUT = "What is the capital of France?"
BODIES: dict[Kind, bytes] = {
    "json": request_body(False),
    "sse": request_body(True),
    "embeddings": orjson.dumps({"model": GATEWAY_EMBEDDINGS_ID, "input": EMBEDDINGS_INPUT}),
}
STREAM_MARK = b'"stream":true'
REQUEST_HEADERS = {"content-type": "application/json", "authorization": f"Bearer {MASTER_KEY}"}


@dataclass(frozen=True)
class Cell:
    """One kind of request at one number of connections."""

    kind: Kind
    connections: int

    @property
    def label(self) -> str:
        return f"{KIND_LABEL[self.kind]} c={self.connections}"
