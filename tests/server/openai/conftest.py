"""The stores of the Files and Batch APIs and the owners of stored responses, on local disk
and on a real redis-server."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from foundation.redis_client import RedisClient, open_redis
from server.openai.batches.redis_store import RedisBatchStore
from server.openai.batches.store import BatchStore, DiskBatchStore
from server.openai.files.redis_store import RedisFileStore
from server.openai.files.store import DiskFileStore, FileStore
from server.openai.responses.owners import ResponseOwners
from server.stores.site import StoreSite
from tests.support.stepped_clock import SteppedClock


@dataclass
class Stores:
    files: FileStore
    batches: BatchStore
    responses: ResponseOwners
    clock: SteppedClock
    redis: RedisClient | None
    prefix: str


StoresFactory = Callable[..., Stores]


@pytest.fixture(
    params=[
        "disk",
        pytest.param("redis", marks=pytest.mark.slow),
        pytest.param("cluster", marks=pytest.mark.slow),
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make_stores(
    request: pytest.FixtureRequest, store_kind: str, tmp_path: Path
) -> AsyncIterator[StoresFactory]:
    """Builds a file store and a batch store of one kind; stores built by one test share
    their storage (as gateways on one disk or one Redis do)."""
    prefix = f"t{uuid.uuid4().hex[:10]}:openai"
    clients: list[RedisClient] = []

    def make(retention_s: float = 3600.0, clock: SteppedClock | None = None) -> Stores:
        clock = clock or SteppedClock(time.time())  # Redis TTLs run on the server's own clock
        if store_kind == "disk":
            return Stores(
                DiskFileStore(tmp_path / "files", retention_s=retention_s, clock=clock),
                DiskBatchStore(tmp_path / "batches", retention_s=retention_s, clock=clock),
                ResponseOwners(
                    StoreSite(tmp_path).store("resp", folder="responses"), retention_s=None
                ),
                clock,
                None,
                prefix,
            )
        server = request.getfixturevalue(
            "redis_cluster" if store_kind == "cluster" else "redis_server"
        )
        client = open_redis(str(server.url))
        clients.append(client)
        return Stores(
            RedisFileStore(client, prefix=prefix, retention_s=retention_s, clock=clock),
            RedisBatchStore(client, prefix=prefix, retention_s=retention_s, clock=clock),
            ResponseOwners(
                StoreSite(tmp_path, redis=client, prefix=prefix).store("resp"),
                retention_s=retention_s,
            ),
            clock,
            client,
            prefix,
        )

    try:
        yield make
    finally:
        for c in clients:
            await c.aclose()
