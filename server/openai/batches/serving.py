"""The Batch API's logic: a batch is validated whole, queued as one job of the durable queue
(its lines run by the batch workers), and finalized into output and error files once every
line has its result."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from backends.registry import ModelRegistry
from server.batch.queue.base import BatchQueue
from server.batch.results import StoredItem
from server.batch.settings import BatchSettings
from server.batch.traces import submit_traced
from server.errors import ApiError
from server.http.reply import Reply
from server.openai.batches.protocol import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    PAYLOAD_KEY,
    BatchCreate,
    BatchError,
    BatchErrors,
    BatchObject,
    RequestCounts,
)
from server.openai.batches.store import BatchStore
from server.openai.batches.validate import check_input
from server.openai.files.serving import json_reply, not_found, page_limit
from server.openai.files.store import FileStore
from server.openai.protocol import ListPage, public
from server.openai.records import new_id

VALIDATING_GRACE_S = 60.0
"""A batch still ``validating`` this long after its creation was interrupted (the gateway
died between checking it and queueing it) unless its job is in the queue."""

COUNTS_TTL_S = 1.0
"""How stale a running batch's ``request_counts`` may be."""

MEMO_SIZE = 10_000
"""Most stopped batches a gateway remembers (then it forgets them and reads their records)."""


class _Status(msgspec.Struct):
    status_code: int


class _Line(msgspec.Struct):
    response: _Status | None = None
    error: dict[str, Any] | None = None


class _Light(msgspec.Struct):
    """A stored output line, only what counting it needs (the body is skipped unparsed)."""

    response: _Line


_stored = msgspec.json.Decoder(StoredItem)
_light = msgspec.json.Decoder(_Light)


def batch_not_found(batch_id: str) -> ApiError:
    return ApiError(
        404, f"No batch found with id '{batch_id}'.", param="id", code="batch_not_found"
    )


def is_success(line: dict[str, Any]) -> bool:
    response = line.get("response")
    return (
        line.get("error") is None
        and isinstance(response, dict)
        and response.get("status_code") == 200
    )


def skipped(line: dict[str, Any]) -> bool:
    """A line a cancellation kept from running: in neither output file."""
    return (line.get("error") or {}).get("code") == "batch_cancelled"


def batch_usage(usages: list[dict[str, Any] | None]) -> dict[str, Any]:
    prompt = sum(int((u or {}).get("prompt_tokens") or 0) for u in usages)
    completion = sum(int((u or {}).get("completion_tokens") or 0) for u in usages)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class BatchesServing:
    """Implements ``/v1/batches``; the batch workers run the lines (see ``runner.py``)."""

    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        registry: ModelRegistry,
        settings: BatchSettings,
        *,
        queue_of: Callable[[], BatchQueue | None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``queue_of``: the gateway's batch queue once it is open (``BatchSystem.queue``);
        ``None`` while batches are off."""
        self.store = store
        self.files = files
        self.registry = registry
        self.settings = settings
        self._queue_of = queue_of
        self._clock = clock
        self._stopped: dict[str, str] = {}
        self._finalizing = asyncio.Lock()
        self._counts_cache: dict[str, tuple[float, RequestCounts]] = {}

    @property
    def queue(self) -> BatchQueue | None:
        return self._queue_of()

    def _queue(self) -> BatchQueue:
        if self.queue is None:
            raise ApiError(400, "Batches are disabled on this gateway.", code="batch_disabled")
        return self.queue

    def _now(self) -> int:
        return int(self._clock())

    # -- the routes --------------------------------------------------------------------

    async def create(
        self, tenant: str, body: dict[str, Any], models: frozenset[str] | None = None
    ) -> Reply:
        """``models``: what the creating API key may use (``None``: every model); a line
        naming another fails the batch with that line's error, as any invalid line does."""
        queue = self._queue()
        req = msgspec.convert(body, BatchCreate)
        if req.endpoint not in ENDPOINTS:
            raise ApiError(
                400,
                f"Invalid value for 'endpoint': {req.endpoint!r}; this gateway runs "
                + ", ".join(ENDPOINTS)
                + ".",
                param="endpoint",
                code="invalid_value",
            )
        window = COMPLETION_WINDOWS.get(req.completion_window)
        if window is None:
            raise ApiError(
                400,
                "Invalid value for 'completion_window': only '24h' is supported.",
                param="completion_window",
                code="invalid_value",
            )
        source = await self.files.get(tenant, req.input_file_id)
        if source is None:
            raise not_found(req.input_file_id)
        if source.purpose != "batch":
            raise ApiError(
                400,
                f"The file {source.id} was not uploaded with purpose 'batch'.",
                param="input_file_id",
                code="invalid_value",
            )
        data = await self.files.content(tenant, source.id) or b""
        now = self._now()
        batch = BatchObject(
            id=new_id("batch_"),
            tenant=tenant,
            endpoint=req.endpoint,
            input_file_id=source.id,
            completion_window=req.completion_window,
            status="validating",
            created_at=now,
            expires_at=int(now + window),
            metadata=req.metadata,
        )
        checked = check_input(
            data,
            batch_id=batch.id,
            endpoint=req.endpoint,
            registry=self.registry,
            max_lines=self.settings.max_items,
            models=models,
        )
        if checked.errors:  # nothing of an invalid file runs
            batch.status = "failed"
            batch.failed_at = now
            batch.errors = BatchErrors(data=checked.errors)
            await self.store.save(batch)
            return json_reply(public(batch))
        assert checked.model is not None
        batch.model = checked.model
        batch.request_counts = RequestCounts(total=len(checked.lines))
        await self.store.save(batch)  # validating: a crash before the queue has it fails it
        payloads = [msgspec.json.encode({PAYLOAD_KEY: line}) for line in checked.lines]
        await submit_traced(queue, batch.id, tenant, checked.model, payloads)
        batch.status = "in_progress"
        batch.in_progress_at = self._now()
        await self.store.save(batch)
        return json_reply(public(batch))

    async def retrieve(self, tenant: str, batch_id: str) -> Reply:
        return json_reply(public(await self._get(tenant, batch_id)))

    async def list_batches(self, tenant: str, *, after: str | None, limit: str | None) -> Reply:
        count = page_limit(limit, 100) if limit is not None else 20
        batches, more = await self.store.list_batches(tenant, after=after, limit=count)
        return json_reply(ListPage.of([await self.refresh(b) for b in batches], more))

    async def cancel(self, tenant: str, batch_id: str) -> Reply:
        batch = await self._get(tenant, batch_id)
        if batch.status in ("validating", "in_progress"):
            batch.status = "cancelling"
            batch.cancelling_at = self._now()
            self._stopped[batch.id] = "cancelled"
            await self.store.save(batch)
            batch = await self.refresh(batch)
        elif batch.status not in ("cancelling", "cancelled"):
            raise ApiError(
                409,
                f"Cannot cancel a batch with status '{batch.status}'.",
                code="batch_not_cancellable",
            )
        return json_reply(public(batch))

    # -- the workers' side -------------------------------------------------------------

    async def stop_reason(self, tenant: str, batch_id: str) -> str | None:
        """Why the batch's remaining lines must not run (cancelled, expired), or None. The
        record is read at every line (one small read next to a model call): another gateway
        sharing the store may have cancelled the batch."""
        reason = self._stopped.get(batch_id)
        if reason is not None:
            return reason
        batch = await self.store.get(tenant, batch_id)
        if batch is None:
            return None  # a record this gateway cannot see: run the line
        if batch.status in ("cancelling", "cancelled"):
            reason = "cancelled"
        elif self._clock() >= batch.expires_at:
            reason = "expired"
        else:
            return None
        if len(self._stopped) > MEMO_SIZE:
            self._stopped.clear()
        self._stopped[batch_id] = reason
        return reason

    # -- state -------------------------------------------------------------------------

    async def _get(self, tenant: str, batch_id: str) -> BatchObject:
        batch = await self.store.get(tenant, batch_id)
        if batch is None:
            raise batch_not_found(batch_id)  # another tenant's batch too
        return await self.refresh(batch)

    async def refresh(self, batch: BatchObject) -> BatchObject:
        """The batch brought up to date with its job in the queue: counts, and once every
        line has its result, the output and error files (then it is finished)."""
        if batch.finished or self.queue is None:
            return batch
        state = await self.queue.job(batch.id)
        now = self._now()
        if batch.status == "validating":
            if state is None:
                if now - batch.created_at < VALIDATING_GRACE_S:
                    return batch
                return await self._fail(
                    batch,
                    "validation_interrupted",
                    "The gateway stopped before the batch was queued.",
                )
            batch.status = "in_progress"  # queued, then the gateway died before saying so
            batch.in_progress_at = now
            await self.store.save(batch)
        if state is None:  # dropped from the queue (past its maximum age)
            return await self._fail(batch, "batch_lost", "The batch's queued work was dropped.")
        if state.completed < state.total:
            batch.request_counts = await self._counts(batch.id, state.total)
            return batch
        async with self._finalizing:
            return await self._finalize(batch, await self._lines(batch.id))

    async def _counts(self, batch_id: str, total: int) -> RequestCounts:
        """A running batch's counts, read from its results at most every ``COUNTS_TTL_S``
        (polls must not make the gateway decode every result again and again)."""
        now = self._clock()
        cached = self._counts_cache.get(batch_id)
        if cached is not None and now - cached[0] < COUNTS_TTL_S:
            return cached[1]
        assert self.queue is not None
        ok = failed = 0
        for r in await self.queue.results(batch_id):
            line = _light.decode(r.body).response
            if line.error is not None and line.error.get("code") == "batch_cancelled":
                continue
            if (
                line.error is None
                and line.response is not None
                and line.response.status_code == 200
            ):
                ok += 1
            else:
                failed += 1
        counts = RequestCounts(total=total, completed=ok, failed=failed)
        if len(self._counts_cache) > 10_000:
            self._counts_cache.clear()
        self._counts_cache[batch_id] = (now, counts)
        return counts

    async def _lines(self, batch_id: str) -> list[dict[str, Any]]:
        assert self.queue is not None
        return [_stored.decode(r.body).response for r in await self.queue.results(batch_id)]

    async def _finalize(self, batch: BatchObject, lines: list[dict[str, Any]]) -> BatchObject:
        current = await self.store.get(batch.tenant, batch.id)  # another poll may have done it
        if current is not None and current.finished:
            return current
        cancelling = batch.cancelling_at is not None  # also when a crash cut a finalizing
        batch.status = "finalizing"
        batch.finalizing_at = self._now()
        await self.store.save(batch)
        ran = [line for line in lines if not skipped(line)]
        output = [line for line in ran if is_success(line)]
        errors = [line for line in ran if not is_success(line)]
        key = batch.id.removeprefix("batch_")
        if output:
            obj = await self.files.create(
                batch.tenant,
                f"{batch.id}_output.jsonl",
                "batch_output",
                jsonl(output),
                file_id=f"file-{key}-output",
            )
            batch.output_file_id = obj.id
        if errors:
            obj = await self.files.create(
                batch.tenant,
                f"{batch.id}_error.jsonl",
                "batch_output",
                jsonl(errors),
                file_id=f"file-{key}-error",
            )
            batch.error_file_id = obj.id
        batch.request_counts = RequestCounts(
            total=batch.request_counts.total or len(lines),
            completed=len(output),
            failed=len(errors),
        )
        usages = [(line.get("response") or {}).get("body", {}) for line in output]
        batch.usage = batch_usage([u.get("usage") if isinstance(u, dict) else None for u in usages])
        now = self._now()
        if cancelling or self._stopped.get(batch.id) == "cancelled":
            batch.status = "cancelled"
            batch.cancelled_at = now
        elif any((line.get("error") or {}).get("code") == "batch_expired" for line in lines):
            batch.status = "expired"
            batch.expired_at = now
        else:
            batch.status = "completed"
            batch.completed_at = now
        await self.store.save(batch)
        return batch

    async def _fail(self, batch: BatchObject, code: str, message: str) -> BatchObject:
        batch.status = "failed"
        batch.failed_at = self._now()
        batch.errors = BatchErrors(data=[BatchError(code=code, message=message)])
        await self.store.save(batch)
        return batch

    async def sweep(self) -> None:
        """Finalize every batch whose lines are all done (so outputs are written before the
        queue drops the results) and remove expired files and records."""
        for batch in await self.store.unfinished():
            await self.refresh(batch)
        await self.files.purge_expired()
        await self.store.purge_expired()


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)
