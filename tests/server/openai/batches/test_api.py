"""The Files and Batch APIs through the official openai SDK against the app that
``semcache serve`` builds, in front of an in-process fake backend (fast). The slow tests in
``test_slow.py`` run them against the real tiny vLLM."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from litestar.testing import TestClient

from backends.interfaces import UpstreamResponse
from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.batch.settings import BatchSettings, FilesSettings, QueueSettings
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry
from tests.support.waiting import wait_until

CHAT = "/v1/chat/completions"


def line(custom_id: str, content: str = "hi", *, url: str = CHAT, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "chat-model", "messages": [{"role": "user", "content": content}], **body},
    }


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((ln if isinstance(ln, bytes) else orjson.dumps(ln)) + b"\n" for ln in lines)


class GatedGeneration(FakeGeneration):
    """Answers only once ``release`` is set (the app runs on the test client's own thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = 0

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        self.started += 1
        await asyncio.to_thread(self.release.wait, 30.0)
        return await super().post(path, body, ctx)


def gateway(fake: FakeGeneration, data_dir: Path, **batch: Any) -> TestClient[Any]:
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", (), "t", "minilm", "r", "n"))
    config = GatewayConfig(
        data_dir=str(data_dir),
        batch=BatchSettings(max_items=5, files=FilesSettings(max_bytes=4096), **batch),
        auth=AuthSettings(
            tokens=[TokenEntry(token="alice", tenant="a"), TokenEntry(token="bob", tenant="b")]
        ),
    )
    return TestClient(create_app(config, registry=reg))


def redis_queue(url: str) -> QueueSettings:
    """A Redis queue of its own on a shared server: the files and batch records go there too."""
    return QueueSettings(
        kind="redis", redis_url=url, prefix=f"q{uuid.uuid4().hex[:8]}", lease_s=2.0
    )


@pytest.fixture(params=["disk", pytest.param("redis", marks=pytest.mark.slow)])
def http(
    request: pytest.FixtureRequest, fake: FakeGeneration, tmp_path: Path
) -> Iterator[TestClient[Any]]:
    """The gateway with its queue, files and batch records on local disk, or in Redis."""
    batch: dict[str, Any] = {}
    if request.param == "redis":
        batch["queue"] = redis_queue(request.getfixturevalue("redis_server").url)
    with gateway(fake, tmp_path, **batch) as c:
        yield c


def sdk(http: TestClient[Any], key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http.base_url}/v1", api_key=key, http_client=http, max_retries=0
    )


FINISHED = ("completed", "failed", "cancelled", "expired")


def wait_finished(client: openai.OpenAI, batch_id: str, timeout_s: float = 30.0) -> Any:
    wait_until(lambda: client.batches.retrieve(batch_id).status in FINISHED, timeout_s)
    return client.batches.retrieve(batch_id)


def read_lines(client: openai.OpenAI, file_id: str) -> list[Any]:
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()]


def create(client: openai.OpenAI, lines: list[Any], endpoint: Any = CHAT) -> Any:
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def test_upload_create_poll_download(http: TestClient[Any], fake: FakeGeneration) -> None:
    client = sdk(http)
    f = client.files.create(file=("in.jsonl", jsonl([line("a"), line("b")])), purpose="batch")
    assert (f.object, f.purpose, f.filename, f.bytes) == ("file", "batch", "in.jsonl", f.bytes)
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == jsonl([line("a"), line("b")])
    batch = client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"k": "v"}
    )
    assert batch.status == "in_progress" and batch.metadata == {"k": "v"}
    assert batch.model == "chat-model"
    done = wait_finished(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (2, 2)
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    assert done.usage is not None and done.usage.total_tokens == 8
    assert done.output_file_id is not None
    out = read_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["a", "b"]
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    assert len(fake.calls) == 2
    out_file = client.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output"
    listed = client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]


def test_a_cached_line_does_not_reach_the_backend(
    http: TestClient[Any], fake: FakeGeneration
) -> None:
    client = sdk(http)
    first = wait_finished(client, create(client, [line("a", temperature=0)]).id)
    second = wait_finished(client, create(client, [line("b", temperature=0)]).id)
    assert first.status == second.status == "completed"
    assert len(fake.calls) == 1  # the second batch's line was an exact-cache hit


def test_backend_errors_go_to_the_error_file(http: TestClient[Any], fake: FakeGeneration) -> None:
    client = sdk(http)
    bad = line("bad")
    bad["body"]["messages"] = "not a list"
    done = wait_finished(client, create(client, [line("ok"), bad]).id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    assert done.error_file_id is not None
    (err,) = read_lines(client, done.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "messages"


@pytest.mark.parametrize(
    ("lines", "code", "line_no"),
    [
        ([line("a"), b"{not json"], "invalid_json_line", 2),
        ([line("a"), line("a")], "duplicate_custom_id", 2),
        ([line("a", url="/v1/embeddings")], "mismatched_endpoint", 1),
        ([line("a", url="/v1/nope")], "invalid_url", 1),
        ([line("a"), {**line("b"), "body": {"model": "no", "messages": []}}], "model_not_found", 2),
        ([{**line("a"), "body": {"model": "embed-model", "input": "x"}}], "invalid_model", 1),
        ([{**line("a"), "method": "GET"}], "invalid_method", 1),
        ([line(str(i)) for i in range(6)], "too_many_requests", None),
        ([], "empty_file", None),
    ],
)
def test_bad_input_fails_the_batch_with_line_numbers_and_runs_nothing(
    http: TestClient[Any],
    fake: FakeGeneration,
    tmp_path: Path,
    lines: list[Any],
    code: str,
    line_no: int | None,
) -> None:
    client = sdk(http)
    batch = create(client, lines)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data
    assert (batch.errors.data[0].code, batch.errors.data[0].line) == (code, line_no)
    assert client.batches.retrieve(batch.id).status == "failed"
    queue = http.app.state.batch_system.queue
    assert http.blocking_portal.call(queue.job, batch.id) is None  # nothing was queued
    assert fake.calls == []


def test_bad_requests_are_openai_errors(http: TestClient[Any]) -> None:
    client = sdk(http)
    f = client.files.create(file=("in.jsonl", jsonl([line("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=f.id, endpoint="/v1/images", completion_window="24h")  # type: ignore[arg-type]
    assert exc.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
    assert exc.value.body["param"] == "purpose"  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("in.jsonl", b"x" * 5000), purpose="batch")
    assert big.value.status_code == 413
    assert big.value.body["code"] == "file_too_large"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        sdk(http, key="nobody").files.list()


def test_another_tenants_files_and_batches_are_404(http: TestClient[Any]) -> None:
    alice, bob = sdk(http, "alice"), sdk(http, "bob")
    batch = create(alice, [line("a")])
    for call in (
        lambda: bob.files.retrieve(batch.input_file_id),
        lambda: bob.files.content(batch.input_file_id),
        lambda: bob.files.delete(batch.input_file_id),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.batches.create(
            input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert bob.files.list().data == [] and bob.batches.list().data == []
    assert [f.id for f in alice.files.list().data] == [batch.input_file_id]


def _unknown_like(real: str) -> str:
    """An id of ``real``'s form that names nothing: its prefix, other characters."""
    cut = real.rfind("-") + 1
    return real[:cut] + "0" * (len(real) - cut)


def test_a_foreign_id_reads_exactly_as_one_that_never_existed(http: TestClient[Any]) -> None:
    """No answer differs by whether another tenant's object exists: status, error body
    (the id aside) and headers alike."""
    batch = create(sdk(http, "alice"), [line("a")])
    bob = {"authorization": "Bearer bob"}
    calls = [
        ("GET", "/v1/files/{}", batch.input_file_id, None),
        ("GET", "/v1/files/{}/content", batch.input_file_id, None),
        ("DELETE", "/v1/files/{}", batch.input_file_id, None),
        ("GET", "/v1/batches/{}", batch.id, None),
        ("POST", "/v1/batches/{}/cancel", batch.id, None),
        (
            "POST",
            "/v1/batches",
            batch.input_file_id,
            {"input_file_id": "{}", "endpoint": CHAT, "completion_window": "24h"},
        ),
    ]
    for method, path, real, body in calls:
        answers = []
        for oid in (real, _unknown_like(real)):
            json = None if body is None else {k: v.format(oid) for k, v in body.items()}
            r = http.request(method, path.format(oid), headers=bob, json=json)
            headers = {k: v for k, v in r.headers.items() if k not in ("x-request-id", "date")}
            answers.append((r.status_code, r.text.replace(oid, "<id>"), headers))
        assert answers[0] == answers[1], (method, path)
        assert answers[0][0] == 404


def test_files_list_pages_and_delete(http: TestClient[Any]) -> None:
    client = sdk(http)
    ids = [client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(3)]
    page = client.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == ids[:2] and page.has_more
    assert [f.id for f in client.files.list(after=ids[1], order="asc").data] == ids[2:]
    assert [f.id for f in client.files.list(purpose="batch_output").data] == []
    deleted = client.files.delete(ids[0])
    assert (deleted.id, deleted.deleted) == (ids[0], True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.files.delete(ids[0])


def test_batches_list_pages(http: TestClient[Any]) -> None:
    client = sdk(http)
    ids = [create(client, [line("a")]).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    raw = http.get("/v1/batches", params={"limit": 2}, headers={"authorization": "Bearer alice"})
    assert raw.json()["first_id"] == ids[2] and raw.json()["last_id"] == ids[1]
    rest = client.batches.list(after=ids[1])
    assert [b.id for b in rest.data] == ids[:1] and not rest.has_more
    assert [b.id for b in client.batches.list()] == ids[::-1]  # the SDK's auto-pagination


def test_cancel_a_running_batch(tmp_path: Path) -> None:
    """The line running finishes (in the output file); the lines not started never run."""
    fake = GatedGeneration()
    with gateway(fake, tmp_path, max_inflight=1) as http:
        client = sdk(http)
        batch = create(client, [line(str(i)) for i in range(4)])
        wait_until(lambda: fake.started >= 1)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        fake.release.set()
        done = wait_finished(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        assert fake.started == 1
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (4, 1)
        assert done.request_counts.failed == 0 and done.error_file_id is None
        assert done.output_file_id is not None
        assert [o["custom_id"] for o in read_lines(client, done.output_file_id)] == ["0"]
        assert client.batches.cancel(batch.id).status == "cancelled"  # again: a no-op
        completed = wait_finished(client, create(client, [line("x")]).id)
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(completed.id)
