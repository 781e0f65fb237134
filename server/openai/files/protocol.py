"""The Files API's schemas, as the OpenAI SDK reads them (``openai.types.FileObject``)."""

from __future__ import annotations

from typing import Literal

import msgspec

Purpose = Literal["batch", "batch_output"]


class FileObject(msgspec.Struct, kw_only=True):
    """One stored file; ``tenant`` is the gateway's own and never sent to clients."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    tenant: str
    expires_at: int | None = None
    object: Literal["file"] = "file"
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class FileDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool
    object: Literal["file"] = "file"
