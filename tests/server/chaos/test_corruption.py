"""Bytes flipped in the L2 files and in the Redis values between two runs of the
``semcache serve`` process: every damaged copy is detected, none is served, each is counted
(``semcache_exact_integrity_failures_total``)."""

from __future__ import annotations

import random
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.vllm_process import TINY_MODEL_NAME
from tests.conftest import gateway_config
from tests.server.chaos.common import chat, every_tier_policy, metric
from tests.support.configs import write_policy

pytestmark = pytest.mark.slow

N = 100  # entries; each is damaged twice (its L2 copy and its Redis copy)


def flip_l2(folder: Path, rng: random.Random) -> int:
    """Flip one random bit of every stored value, in the SQLite file itself; how many."""
    db = folder / "cache.db"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every row in the main file
        blobs = [
            bytes(v)
            for (v,) in conn.execute("SELECT value FROM Cache WHERE filename IS NULL")
            if isinstance(v, bytes)
        ]
    raw = bytearray(db.read_bytes())
    for blob in blobs:
        offset, bit = rng.randrange(len(blob)), 1 << rng.randrange(8)
        start, found = raw.find(blob), 0
        while start >= 0:  # every copy (a stale one may sit in a free page)
            raw[start + offset] ^= bit
            found += 1
            start = raw.find(blob, start + 1)
        assert found, "a value not stored contiguously in the file"
    db.write_bytes(bytes(raw))
    return len(blobs)


def flip_redis(url: str, rng: random.Random) -> int:
    """Flip one random bit of every exact-cache value in Redis (its TTL kept); how many."""
    client: Any = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match="semcache:exact/*"))
    for key in keys:
        value = bytearray(client.get(key))
        value[rng.randrange(len(value))] ^= 1 << rng.randrange(8)
        client.set(key, bytes(value), keepttl=True)
    client.close()
    return len(keys)


def test_flipped_bytes_in_l2_and_redis_are_all_detected_and_never_served(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess, redis_factory: Any
) -> None:
    server = redis_factory()
    policy = write_policy(tmp_path, every_tier_policy(server.url))
    config = gateway_config(
        tmp_path,
        tiny_vllm.url,
        data_dir / "models" / TINY_MODEL_NAME,
        embeddings=False,
        policy=str(policy),
    )
    config_file = write_config_toml(config, tmp_path / "gateway.toml")
    run = uuid.uuid4().hex[:8]
    bodies = [chat(f"corrupt {run} {i}") for i in range(N)]
    with httpx.Client(timeout=60) as http:
        gw = GatewayProcess(config_file).start()
        try:
            first = [http.post(f"{gw.url}/v1/chat/completions", json=b) for b in bodies]
            assert all(r.headers["cf-aig-cache-status"] == "MISS" for r in first)
        finally:
            gw.stop()  # the disk tier's writes are committed
        rng = random.Random(21)
        assert flip_l2(tmp_path / "cache", rng) == N
        assert flip_redis(server.url, rng) == N

        gw = GatewayProcess(config_file).start()  # empty memory: reads go to L2, then Redis
        try:
            again = [http.post(f"{gw.url}/v1/chat/completions", json=b) for b in bodies]
            disk = metric(gw.url, "semcache_exact_integrity_failures_total", tier="disk")
            l3 = metric(gw.url, "semcache_exact_integrity_failures_total", tier="redis")
            hits = metric(gw.url, "semcache_exact_hits_total")
        finally:
            gw.stop()
    assert [r.status_code for r in again] == [200] * N
    served = sum(r.headers["cf-aig-cache-status"] != "MISS" for r in again)
    assert served == 0 and hits == 0  # not one damaged copy served
    assert (disk, l3) == (N, N)  # every one detected and counted
    for old, new in zip(first, again, strict=True):  # and the answer is the real one
        assert new.json()["choices"] == old.json()["choices"]
    print(
        f"\nFIGURE corruption: {int(disk + l3)} of {2 * N} damaged copies detected "
        f"({int(disk)} L2, {int(l3)} Redis), 0 served"
    )
