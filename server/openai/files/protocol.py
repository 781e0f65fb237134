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

    @classmethod
    def stored(
        cls,
        tenant: str,
        filename: str,
        purpose: Purpose,
        size: int,
        *,
        now: float,
        retention_s: float,
        file_id: str,
    ) -> FileObject:
        """A file stored at ``now`` and kept ``retention_s`` (every store writes these)."""
        return cls(
            id=file_id,
            bytes=size,
            created_at=int(now),
            filename=filename,
            purpose=purpose,
            tenant=tenant,
            expires_at=int(now + retention_s),
        )

    def live(self, now: float) -> bool:
        """Not expired at ``now``."""
        return self.expires_at is None or self.expires_at > now


class FileDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool
    object: Literal["file"] = "file"
