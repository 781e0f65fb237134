"""The Files API's logic: uploads of batch input files, reads, listings and deletions, each
scoped to the tenant that sent the request."""

from __future__ import annotations

from typing import Any

import msgspec

from server.errors import ApiError
from server.http.reply import Reply
from server.openai.files.protocol import FileDeleted, FileObject
from server.openai.files.store import FileStore
from server.openai.protocol import ListPage, public

UPLOAD_PURPOSES = ("batch",)


def not_found(file_id: str) -> ApiError:
    # Another tenant's file is indistinguishable from one that does not exist.
    return ApiError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


def json_reply(obj: Any, status: int = 200) -> Reply:
    return Reply(status, msgspec.json.encode(obj))


class FilesServing:
    """Implements ``/v1/files``."""

    def __init__(self, store: FileStore, max_bytes: int) -> None:
        self.store = store
        self.max_bytes = max_bytes

    def too_large(self, size: int) -> ApiError:
        return ApiError(
            413,
            f"The file is {size} bytes; the limit is {self.max_bytes} bytes.",
            param="file",
            code="file_too_large",
        )

    async def upload(self, tenant: str, filename: str, purpose: Any, data: bytes) -> Reply:
        if purpose not in UPLOAD_PURPOSES:
            raise ApiError(
                400,
                f"Invalid value for 'purpose': {purpose!r}; this gateway accepts "
                + ", ".join(f"'{p}'" for p in UPLOAD_PURPOSES)
                + ".",
                param="purpose",
                code="invalid_value",
            )
        if len(data) > self.max_bytes:
            raise self.too_large(len(data))
        obj = await self.store.create(tenant, filename or "upload.jsonl", "batch", data)
        return json_reply(public(obj))

    async def get(self, tenant: str, file_id: str) -> FileObject:
        obj = await self.store.get(tenant, file_id)
        if obj is None:
            raise not_found(file_id)
        return obj

    async def retrieve(self, tenant: str, file_id: str) -> Reply:
        return json_reply(public(await self.get(tenant, file_id)))

    async def content(self, tenant: str, file_id: str) -> Reply:
        data = await self.store.content(tenant, file_id)
        if data is None:
            raise not_found(file_id)
        return Reply(200, data, media_type="application/jsonl")

    async def list_files(
        self,
        tenant: str,
        *,
        purpose: str | None,
        order: str | None,
        after: str | None,
        limit: str | None,
    ) -> Reply:
        if order not in (None, "asc", "desc"):
            raise ApiError(
                400,
                "Invalid value for 'order': 'asc' or 'desc'.",
                param="order",
                code="invalid_value",
            )
        count = page_limit(limit, 10000)
        objs, more = await self.store.list_files(
            tenant, purpose=purpose, order=order or "desc", after=after, limit=count
        )
        return json_reply(ListPage.of(objs, more))

    async def delete(self, tenant: str, file_id: str) -> Reply:
        if not await self.store.delete(tenant, file_id):
            raise not_found(file_id)
        return json_reply(FileDeleted(id=file_id, deleted=True))


def page_limit(raw: str | None, most: int) -> int:
    """A list's ``limit`` query parameter, 1 to ``most`` (absent: ``most``); else a 400."""
    if raw is None:
        return most
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise ApiError(
            400,
            f"Invalid value for 'limit': an integer from 1 to {most}.",
            param="limit",
            code="invalid_value",
        )
    return value
