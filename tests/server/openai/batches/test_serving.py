"""The batch serving object on a real disk queue with an injected clock, its records and
files on disk or in Redis: a batch past its completion window expires, and its remaining
lines do not run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest

from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from server.batch.queue.disk import DiskQueue
from server.batch.results import StoredItem
from server.batch.settings import BatchSettings
from server.openai.batches.runner import OpenAIItemRunner
from server.openai.batches.serving import BatchesServing
from tests.server.openai.conftest import StoresFactory
from tests.support.stepped_clock import SteppedClock


def input_file(n: int) -> bytes:
    body = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(n)
    ]
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


@pytest.fixture
async def parts(tmp_path: Path, make_stores: StoresFactory) -> Any:
    clock = SteppedClock(1_000_000.0)
    reg = ModelRegistry()
    reg.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
    stores = make_stores(retention_s=30 * 86400.0, clock=clock)
    files = stores.files
    batches = BatchesServing(
        stores.batches, files, reg, BatchSettings(), queue_of=lambda: queue, clock=clock
    )
    queue = await DiskQueue.open(tmp_path / "q.sqlite3", clock=clock)
    yield clock, files, batches, queue
    await queue.aclose()


async def test_a_batch_past_its_window_expires_and_its_lines_do_not_run(parts: Any) -> None:
    clock, files, batches, queue = parts
    upload = await files.create("t", "in.jsonl", "batch", input_file(3))
    reply = await batches.create(
        "t",
        {
            "input_file_id": upload.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    created = orjson.loads(reply.body)
    assert created["expires_at"] == created["created_at"] + 86400
    clock.now += 86400 + 1
    # serving is never reached: every line is stopped before it runs
    runner = OpenAIItemRunner({}, batches.stop_reason)
    for item in await queue.claim("w", 10, wait_s=0):
        body = orjson.loads(item.payload)
        ctx = RequestContext(request_id="r", tenant=item.tenant)
        outcome = await runner.run_item(item.model, body["openai_batch"], ctx)
        assert outcome.response is not None
        stored = StoredItem(response=outcome.response, usage=outcome.usage)
        await queue.complete(item, msgspec.json.encode(stored))
    done = orjson.loads((await batches.retrieve("t", created["id"])).body)
    assert done["status"] == "expired" and done["expired_at"] == int(clock.now)
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert done["output_file_id"] is None
    errors = (await files.content("t", done["error_file_id"])).splitlines()
    assert [orjson.loads(e)["error"]["code"] for e in errors] == ["batch_expired"] * 3


@pytest.mark.parametrize("cancelled", [False, True])
async def test_a_finalization_cut_by_a_crash_runs_again(parts: Any, cancelled: bool) -> None:
    """A record left ``finalizing`` (the gateway died while writing the outputs) is
    finalized again on the next read, with the status it was heading for."""
    _, files, batches, queue = parts
    upload = await files.create("t", "in.jsonl", "batch", input_file(2))
    reply = await batches.create(
        "t",
        {
            "input_file_id": upload.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    batch_id = orjson.loads(reply.body)["id"]
    for item in await queue.claim("w", 10, wait_s=0):
        line = orjson.loads(item.payload)["openai_batch"]
        response = {"status_code": 200, "request_id": "r", "body": {"usage": {}}}
        out = {"id": "x", "custom_id": line["custom_id"], "response": response, "error": None}
        await queue.complete(item, msgspec.json.encode(StoredItem(response=out)))
    record = await batches.store.get("t", batch_id)
    record.status = "finalizing"
    record.cancelling_at = record.created_at if cancelled else None
    await batches.store.save(record)
    batches._stopped.clear()  # a restarted gateway
    done = orjson.loads((await batches.retrieve("t", batch_id)).body)
    assert done["status"] == ("cancelled" if cancelled else "completed")
    assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    out_lines = (await files.content("t", done["output_file_id"])).splitlines()
    assert [orjson.loads(x)["custom_id"] for x in out_lines] == ["c0", "c1"]


async def test_a_batch_left_validating_is_in_progress_once_queued_else_fails(parts: Any) -> None:
    clock, files, batches, _ = parts
    upload = await files.create("t", "in.jsonl", "batch", input_file(1))
    body = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions"}
    queued = orjson.loads((await batches.create("t", {**body, "completion_window": "24h"})).body)
    record = await batches.store.get("t", queued["id"])
    record.status = "validating"  # the gateway died after queueing, before saying so
    await batches.store.save(record)
    assert orjson.loads((await batches.retrieve("t", record.id)).body)["status"] == "in_progress"
    record.id = "batch_never_queued"  # the gateway died before queueing
    record.status = "validating"
    await batches.store.save(record)
    assert orjson.loads((await batches.retrieve("t", record.id)).body)["status"] == "validating"
    clock.now += 61
    failed = orjson.loads((await batches.retrieve("t", record.id)).body)
    assert failed["status"] == "failed"
    assert failed["errors"]["data"][0]["code"] == "validation_interrupted"


async def test_a_payload_not_queued_by_the_batch_api_is_answered_not_retried() -> None:
    async def never(tenant: str, batch_id: str) -> str | None:
        raise AssertionError("not reached")

    runner = OpenAIItemRunner({}, never)
    outcome = await runner.run_item("m", {"custom_id": 1}, RequestContext(request_id="r"))
    assert not outcome.success and not outcome.retryable and outcome.response is None
