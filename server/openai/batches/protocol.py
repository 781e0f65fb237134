"""The Batch API's schemas, as the OpenAI SDK reads them (``openai.types.Batch``), and the
lines of its input and output files."""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from backends.registry import Task

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]

ENDPOINTS: Final[dict[str, Task]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "chat",
    "/v1/embeddings": "embeddings",
}
"""The endpoints a batch may run, and the task each one's model must serve."""

COMPLETION_WINDOWS: Final = {"24h": 86400.0}

PAYLOAD_KEY: Final = "openai_batch"
"""The key of a queued item's payload that marks it as an OpenAI batch line."""


class BatchCreate(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """The body of ``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class BatchError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(msgspec.Struct, kw_only=True):
    """One batch; ``tenant`` is the gateway's own and never sent to clients."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    object: Literal["batch"] = "batch"
    model: str | None = None
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    usage: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.status in ("failed", "completed", "expired", "cancelled")


class InputLine(msgspec.Struct, kw_only=True):
    """One valid line of an input file, as queued (under :data:`PAYLOAD_KEY`)."""

    batch_id: str
    line: int
    custom_id: str
    url: str
    body: dict[str, Any]
