"""What the server calls on a backend: the contract every backend implements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
import numpy as np

from foundation.request import RequestContext

FailureKind = Literal["unreachable", "timeout", "overloaded", "unavailable", "broken"]


class BackendError(Exception):
    """The backend could not answer: unreachable, timed out, overloaded or broke mid-answer."""

    def __init__(self, kind: FailureKind, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind
        self.message = message
        self.retry_after_s = retry_after_s


class UpstreamRejected(Exception):
    """The backend answered, refusing the request (a 4xx, e.g. an input over its context).

    ``message`` is the backend's own when its answer carries one (OpenAI's error shape).
    """

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    @classmethod
    def from_answer(cls, status: int, body: bytes) -> UpstreamRejected:
        message, code = f"The backend refused the request ({status}).", None
        try:
            error = msgspec.json.decode(body).get("error")
        except (msgspec.DecodeError, AttributeError):
            error = None
        if isinstance(error, dict):
            if isinstance(error.get("message"), str) and error["message"]:
                message = error["message"]
            if isinstance(error.get("code"), str):
                code = error["code"]
        return cls(status, message, code)


class UpstreamResponse(msgspec.Struct, kw_only=True):
    """A complete (non-streamed) answer of an OpenAI-protocol server, bytes untouched."""

    status: int
    body: bytes
    content_type: str = "application/json"


class UpstreamStream(Protocol):
    """An open streamed answer: status is known before the first chunk is relayed."""

    status: int
    content_type: str

    def chunks(self) -> AsyncIterator[bytes]:
        """Raw bytes as they arrive; raises BackendError if the stream breaks."""
        ...

    async def read_all(self) -> bytes: ...

    async def aclose(self) -> None:
        """Stop the upstream request (the backend aborts its generation)."""
        ...


class GenerationBackend(Protocol):
    """An OpenAI-protocol text generation backend (vLLM, monolithic or P/D)."""

    name: str
    served_model: str

    async def post(
        self, path: str, body: dict[str, Any], ctx: RequestContext
    ) -> UpstreamResponse: ...

    async def open_stream(
        self, path: str, body: dict[str, Any], ctx: RequestContext
    ) -> UpstreamStream: ...

    async def ready(self) -> bool: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class KnowsContext(Protocol):
    """A generation backend that can say its model's context length."""

    async def max_model_len(self) -> int | None:
        """The context length in tokens; ``None`` when it cannot be learnt now."""
        ...


@runtime_checkable
class StoredResponses(Protocol):
    """A generation backend whose servers keep answers a client may fetch by id later (the
    Responses API's ``GET /v1/responses/{id}``)."""

    async def fetch(self, path: str, ctx: RequestContext) -> UpstreamResponse | None:
        """``GET path`` from the servers until one answers other than 404; ``None`` when
        no server could be asked."""
        ...


class Embeddings(msgspec.Struct, kw_only=True):
    vectors: Any  # np.ndarray float32 of shape (n, dim)
    token_counts: list[int]


class EmbeddingBackend(Protocol):
    """Encodes texts into vectors (in-process or remote)."""

    name: str
    dimensions: int

    async def start(self) -> None:
        """Load the model; idempotent."""
        ...

    async def embed(self, texts: list[str]) -> Embeddings: ...

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text as ``embed`` would count them (for usage of cached items)."""
        ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def vocab_size(self) -> int:
        """How many token ids the model's tokenizer knows (0 to this less one); after
        ``start``."""
        ...

    async def ready(self) -> bool: ...

    async def aclose(self) -> None: ...


def as_float32(vectors: Any) -> np.ndarray:
    return np.ascontiguousarray(vectors, dtype=np.float32)
