"""Two gateways built by ``create_app`` on one Redis, each with its own data dir and an
in-process fake backend: a batch uploaded and created through one is polled, listed,
cancelled and downloaded through the other (as behind a load balancer), and its lines run
exactly once between them. ``test_slow.py`` proves it against the real tiny vLLM."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from litestar.testing import TestClient
from redis import Redis

from harness.fake_vllm import FakeGeneration
from server.batch.settings import QueueSettings
from tests.semcache.conftest import RedisServer
from tests.server.openai.batches.test_api import (
    CHAT,
    GatedGeneration,
    create,
    gateway,
    jsonl,
    line,
    read_lines,
    sdk,
    wait_finished,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # a real redis-server

Pair = tuple[TestClient[Any], TestClient[Any]]


@pytest.fixture
def queue(redis_server: RedisServer) -> QueueSettings:
    prefix = f"q{uuid.uuid4().hex[:8]}"
    return QueueSettings(kind="redis", redis_url=redis_server.url, prefix=prefix, lease_s=2.0)


@contextmanager
def two_gateways(
    fakes: tuple[FakeGeneration, FakeGeneration], tmp_path: Path, queue: QueueSettings, **batch: Any
) -> Iterator[Pair]:
    with (
        gateway(fakes[0], tmp_path / "one", queue=queue, **batch) as one,
        gateway(fakes[1], tmp_path / "two", queue=queue, **batch) as two,
    ):
        yield one, two


def test_a_batch_created_on_one_gateway_is_polled_and_downloaded_on_the_other(
    tmp_path: Path, queue: QueueSettings
) -> None:
    fakes = (FakeGeneration(), FakeGeneration())
    with two_gateways(fakes, tmp_path, queue) as (one, two):
        first, second = sdk(one), sdk(two)
        lines = [line(f"q{i}", f"question {i}") for i in range(5)]
        f = first.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert second.files.retrieve(f.id).bytes == f.bytes
        assert second.files.content(f.id).content == jsonl(lines)
        batch = first.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        assert [b.id for b in second.batches.list().data] == [batch.id]
        done = wait_finished(second, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
        assert done.output_file_id is not None and done.error_file_id is None
        out = read_lines(second, done.output_file_id)
        assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(5)]  # each once, in order
        assert len({o["id"] for o in out}) == 5
        assert read_lines(first, done.output_file_id) == out
        assert first.batches.retrieve(batch.id).status == "completed"
        assert len(fakes[0].calls) + len(fakes[1].calls) == 5  # every line ran exactly once
        listed = {x.id for x in second.files.list().data}
        assert listed == {f.id, done.output_file_id}
        with pytest.raises(openai.NotFoundError):  # tenants stay apart on every gateway
            sdk(two, "bob").batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            sdk(one, "bob").files.content(done.output_file_id)
        assert second.files.delete(f.id).deleted
        with pytest.raises(openai.NotFoundError):
            first.files.retrieve(f.id)


def test_a_cancel_on_one_gateway_stops_the_lines_on_both(
    tmp_path: Path, queue: QueueSettings
) -> None:
    fakes = (GatedGeneration(), GatedGeneration())
    with two_gateways(fakes, tmp_path, queue, max_inflight=1) as (one, two):
        first, second = sdk(one), sdk(two)
        batch = create(first, [line(str(i)) for i in range(5)])
        wait_until(lambda: fakes[0].started + fakes[1].started >= 1)
        assert second.batches.cancel(batch.id).status == "cancelling"
        for fake in fakes:
            fake.release.set()
        done = wait_finished(first, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        ran = fakes[0].started + fakes[1].started
        assert 1 <= ran <= 2  # at most the line each gateway had started before the cancel
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (5, ran)
        assert done.output_file_id is not None
        assert len(read_lines(second, done.output_file_id)) == ran


def test_a_full_or_unreachable_redis_is_a_507_or_a_503(
    tmp_path: Path, redis_factory: Callable[[], RedisServer]
) -> None:
    server = redis_factory()
    queue = QueueSettings(kind="redis", redis_url=server.url, prefix="q")
    with gateway(FakeGeneration(), tmp_path, queue=queue) as http:
        client = sdk(http)
        client.files.create(file=("small.jsonl", jsonl([line("a")])), purpose="batch")
        with Redis.from_url(server.url) as admin:  # over its maxmemory, evicting nothing
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] // 2))
        with pytest.raises(openai.APIStatusError) as full:
            client.files.create(file=("big.jsonl", b"x" * 4000), purpose="batch")
        assert full.value.status_code == 507
        assert full.value.body["code"] == "insufficient_storage"  # type: ignore[index]
        server.stop()
        with pytest.raises(openai.APIStatusError) as down:
            client.files.list()
        assert down.value.status_code == 503
        assert down.value.body["code"] == "store_unavailable"  # type: ignore[index]
