"""Submitting a batch (every item into the durable queue, answered at once) and polling it."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import orjson

from server.batch.queue.base import BatchQueue, JobState
from server.batch.results import StoredItem, sum_usage
from server.batch.settings import BatchSettings
from server.batch.traces import submit_traced
from server.errors import ApiError


class BatchService:
    """Accepts batches and answers polls; never runs items itself."""

    def __init__(self, queue: BatchQueue, settings: BatchSettings) -> None:
        self.queue = queue
        self.settings = settings

    async def submit(self, tenant: str, model: str, requests: Any) -> dict[str, Any]:
        """Queue ``requests`` (the items) for ``model``; the ``queued`` result to answer."""
        if not isinstance(requests, list) or not requests:
            raise ApiError(
                400,
                "A queued request needs `requests`: a non-empty list of inputs.",
                param="requests",
                code="invalid_value",
            )
        limit = self.settings.max_items
        if len(requests) > limit:
            raise ApiError(
                400,
                f"Too many items in `requests`: {len(requests)}; "
                f"the limit is {limit} items per batch.",
                param="requests",
                code="too_many_items",
            )
        for i, item in enumerate(requests):
            if not isinstance(item, dict):
                raise ApiError(
                    400,
                    f"Invalid value for 'requests[{i}]': expected an object.",
                    param=f"requests[{i}]",
                    code="invalid_value",
                )
            ref = item.get("external_reference")
            if ref is not None and not isinstance(ref, str):
                raise ApiError(
                    400,
                    f"Invalid value for 'requests[{i}].external_reference': expected a string.",
                    param=f"requests[{i}].external_reference",
                    code="invalid_value",
                )
        job_id = str(uuid.uuid4())
        await submit_traced(self.queue, job_id, tenant, model, [orjson.dumps(r) for r in requests])
        return {"status": "queued", "request_id": job_id, "model": model}

    async def state(self, tenant: str, request_id: Any) -> JobState:
        if not isinstance(request_id, str) or not request_id:
            raise ApiError(
                400, "`request_id` must be a string.", param="request_id", code="invalid_value"
            )
        state = await self.queue.job(request_id)
        if state is None or state.tenant != tenant:
            # Another tenant's batch is indistinguishable from one that does not exist.
            raise ApiError(
                404, f"No queued request with id `{request_id}`.", code="request_not_found"
            )
        return state

    async def poll(self, tenant: str, request_id: Any) -> dict[str, Any]:
        """The batch's status while it runs; its responses and usage once it is done."""
        state = await self.state(tenant, request_id)
        if state.status != "done":
            return {"status": state.status, "request_id": state.id}
        decoder = msgspec.json.Decoder(StoredItem)
        stored = [decoder.decode(r.body) for r in await self.queue.results(state.id)]
        return {
            "responses": [s.response for s in stored],
            "usage": sum_usage([s.usage for s in stored]),
        }
