"""The Files and Batch APIs through the official openai SDK against the real gateway in
front of the real tiny vLLM: a batch runs to completion (chat and embeddings), a running
batch is cancelled, and ``kill -9`` of the gateway mid-batch loses and repeats no line."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME
from server.batch.settings import BatchSettings, QueueSettings
from server.config import GatewayConfig
from tests.conftest import gateway_config
from tests.semcache.conftest import RedisServer
from tests.server.workers_ai.test_api import (
    TOKEN,
    leased_items,
    stored_results,
    write_gateway_toml,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
FINISHED = ("completed", "failed", "cancelled", "expired")


def chat_lines(n: int, max_tokens: int, prefix: str = "") -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": f"{prefix}story number {i}"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


def wait_finished(client: openai.OpenAI, batch_id: str, timeout_s: float = 300.0) -> Any:
    def finished() -> bool:
        status = client.batches.retrieve(batch_id).status
        assert status in (*FINISHED, "validating", "in_progress", "finalizing", "cancelling")
        return status in FINISHED

    wait_until(finished, timeout_s, interval_s=0.2)
    return client.batches.retrieve(batch_id)


def read_lines(client: openai.OpenAI, file_id: str) -> list[Any]:
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()]


def finished_items(gw: GatewayProcess) -> dict[str, float]:
    """The batch items ``gw`` finished, by outcome (``semcache_batch_items_total``)."""
    page = httpx.get(f"{gw.url}/metrics", timeout=30).text
    outcomes = ("success", "failure", "duplicate")
    return {o: parse_metric(page, "semcache_batch_items_total", {"outcome": o}) for o in outcomes}


@pytest.fixture(scope="module")
def gw(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    batch = BatchSettings(max_inflight=2, queue=QueueSettings(lease_s=2.0))
    tmp = tmp_path_factory.mktemp("gw")
    config = gateway_config(tmp, tiny_vllm.url, data_dir / "models" / TINY_MODEL_NAME, batch=batch)
    gateway = GatewayProcess(write_config_toml(config, tmp / "gateway.toml"))
    try:
        yield gateway.start()
    finally:
        gateway.stop()


@pytest.fixture
def client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sdk-key", max_retries=0)


def test_chat_batch_runs_to_completion_and_matches_live_answers(client: openai.OpenAI) -> None:
    f = client.files.create(file=("in.jsonl", chat_lines(4, 8)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    done = wait_finished(client, batch.id)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 0)
    assert done.output_file_id is not None and done.error_file_id is None
    out = read_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(4)]
    live = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "story number 2"}],
        max_tokens=8,
        temperature=0,
    )
    answer = out[2]["response"]["body"]
    assert out[2]["response"]["status_code"] == 200
    # the line filled the exact cache: the live request is answered with the same completion
    assert answer["choices"][0]["message"]["content"] == live.choices[0].message.content
    assert answer["id"] == live.id


def test_embeddings_batch(client: openai.OpenAI) -> None:
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "all-MiniLM-L6-v2", "input": [f"text {i}", "another"]},
        }
        for i in range(3)
    ]
    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    f = client.files.create(file=("emb.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = wait_finished(client, batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    out = read_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["e0", "e1", "e2"]
    vectors = out[0]["response"]["body"]["data"]
    assert len(vectors) == 2 and len(vectors[0]["embedding"]) == 384


def test_cancel_a_running_batch(client: openai.OpenAI) -> None:
    n = 30
    lines = chat_lines(n, 64, prefix=f"{uuid.uuid4().hex} ")
    f = client.files.create(file=("in.jsonl", lines), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")

    def started() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed >= 1

    wait_until(started, 120, interval_s=0.1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts is not None
    ran = done.request_counts.completed
    assert 1 <= ran < n and done.request_counts.failed == 0
    assert done.output_file_id is not None and done.error_file_id is None
    out = read_lines(client, done.output_file_id)
    assert len(out) == ran and all(o["response"]["status_code"] == 200 for o in out)


def test_kill_9_mid_batch_every_line_exactly_once(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path: Path
) -> None:
    n = 40
    db = tmp_path / "queue.sqlite3"
    config = tmp_path / "gateway.toml"
    write_gateway_toml(config, data_dir, tiny_vllm.url, {"path": str(db), "lease_s": 2.0})
    with config.open("a") as toml:
        toml.write(f'\n[batch.files]\ndir = "{tmp_path / "openai"}"\n')
    first = GatewayProcess(config).start()
    try:
        sdk = openai.OpenAI(base_url=f"{first.url}/v1", api_key=TOKEN, max_retries=2)
        # the gateway's cache tiers live in the shared data dir: prompts of this run only
        lines = chat_lines(n, 48, prefix=f"{uuid.uuid4().hex} ")
        f = sdk.files.create(file=("in.jsonl", lines), purpose="batch")
        batch = sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        wait_until(lambda: len(stored_results(db, batch.id)) >= 4, 240, interval_s=0.05)
        first.kill()
        before = stored_results(db, batch.id)
        assert 4 <= len(before) < n, "kill the gateway mid-batch"
        assert leased_items(db) > 0, "the killed gateway held leases"
        second = GatewayProcess(config, port=first.port).start()
        try:
            done = wait_finished(sdk, batch.id)
            assert done.status == "completed"
            assert done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
            out = read_lines(sdk, done.output_file_id)
        finally:
            second.stop()
    finally:
        first.kill()
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(n)]
    assert len({o["id"] for o in out}) == n
    after = stored_results(db, batch.id)
    assert all(after[i] == body for i, body in before.items())  # finished work never redone


def test_two_gateways_on_one_redis_share_files_and_batches(
    data_dir: Path,
    tiny_vllm: VllmProcess,
    tmp_path: Path,
    redis_server: RedisServer,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    """Upload and create through one gateway, poll and download through the other (each
    with its own data dir: only Redis is shared); both run lines, each line exactly once."""
    queue = QueueSettings(
        kind="redis", redis_url=redis_server.url, prefix=f"ob{uuid.uuid4().hex[:8]}", lease_s=2.0
    )
    model = data_dir / "models" / TINY_MODEL_NAME
    batch = BatchSettings(max_inflight=2, queue=queue)
    one = start_gateway(gateway_config(tmp_path / "one", tiny_vllm.url, model, batch=batch))
    two = start_gateway(gateway_config(tmp_path / "two", tiny_vllm.url, model, batch=batch))
    first = openai.OpenAI(base_url=f"{one.url}/v1", api_key="sdk-key", max_retries=0)
    second = openai.OpenAI(base_url=f"{two.url}/v1", api_key="sdk-key", max_retries=0)
    n = 24
    lines = chat_lines(n, 24, prefix=f"{uuid.uuid4().hex} ")
    f = first.files.create(file=("in.jsonl", lines), purpose="batch")
    created = first.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    assert second.files.content(f.id).content == lines
    done = wait_finished(second, created.id)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    assert done.output_file_id is not None and done.error_file_id is None
    out = read_lines(second, done.output_file_id)
    assert read_lines(first, done.output_file_id) == out
    assert first.batches.retrieve(created.id).status == "completed"
    ran = [finished_items(g) for g in (one, two)]
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(n)]
    assert len({o["id"] for o in out}) == n
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert ran[0]["success"] > 0 and ran[1]["success"] > 0, ran  # both pulled work
    assert ran[0]["success"] + ran[1]["success"] == n  # every line ran exactly once
