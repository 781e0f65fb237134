"""The stores a site hands out (a local directory, a Redis, a Redis Cluster): Litestar's
``Store`` contract, one namespace per name, and the key layout records had before."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from litestar.stores.base import NamespacedStore

from foundation.redis_client import RedisClient, open_redis
from server.openai.records import tenant_key
from server.openai.responses.owners import ResponseOwners
from server.stores.directory import DirectoryStore
from server.stores.site import StoreSite, open_site
from tests.semcache.conftest import RedisServer


@pytest.fixture(
    params=[
        "disk",
        pytest.param("redis", marks=pytest.mark.slow),
        pytest.param("cluster", marks=pytest.mark.slow),
    ]
)
async def site(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreSite]:
    if request.param == "disk":
        yield open_site(tmp_path)
        return
    server = request.getfixturevalue(
        "redis_cluster" if request.param == "cluster" else "redis_server"
    )
    made = open_site(tmp_path, str(server.url), prefix=f"t{uuid.uuid4().hex[:10]}")
    try:
        yield made
    finally:
        await made.aclose()


async def test_a_store_keeps_values_until_they_expire(site: StoreSite) -> None:
    store = site.store("things")
    await store.set("ab12/one", b"1")
    await store.set("ab12/two", "2", expires_in=1)
    assert await store.get("ab12/one") == b"1"
    assert await store.get("ab12/two") == b"2"
    assert await store.expires_in("ab12/one") is None
    assert await store.expires_in("ab12/two") in (0, 1)
    assert await store.exists("ab12/one")
    await asyncio.sleep(1.2)
    assert await store.get("ab12/two") is None
    assert not await store.exists("ab12/two")
    await store.delete("ab12/one")
    assert await store.get("ab12/one") is None
    await store.delete("ab12/one")  # absent: fine


async def test_each_name_is_a_namespace_of_its_own(site: StoreSite) -> None:
    one, two = site.store("one"), site.store("two")
    assert site.store("one") is one
    await one.set("ab12/x", b"1")
    await one.set("plain", b"1")
    await two.set("ab12/x", b"2")
    child = one.with_namespace("child")
    await child.set("ab12/x", b"3")
    assert (await one.get("ab12/x"), await two.get("ab12/x")) == (b"1", b"2")
    await one.delete_all()  # the namespace and its children, not the neighbour's
    assert await one.get("ab12/x") is None
    assert await one.get("plain") is None
    assert await child.get("ab12/x") is None
    assert await two.get("ab12/x") == b"2"


@pytest.mark.slow
async def test_a_redis_key_carries_its_tag_and_millisecond_expiry(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}:openai"
    client: RedisClient = open_redis(str(redis_server.url))
    try:
        store = StoreSite(tmp_path, redis=client, prefix=prefix).store("resp")
        await store.set("T1/resp_a", b"", expires_in=1)
        assert 0 < await client.pttl(f"{prefix}:{{T1}}:resp:resp_a") <= 1000
        await store.set("plain", b"v")
        assert await client.get(f"{prefix}:resp:plain") == b"v"
    finally:
        await client.aclose()


async def test_a_response_owner_recorded_before_the_store_is_still_owned(tmp_path: Path) -> None:
    """An owner written by the earlier disk form: an empty file ``responses/<T>/<id>``."""
    legacy = tmp_path / "responses" / tenant_key("acme") / "resp_old1"
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(b"")
    owners = ResponseOwners(StoreSite(tmp_path).store("resp", folder="responses"), retention_s=None)
    assert await owners.owns("acme", "resp_old1")
    assert not await owners.owns("other", "resp_old1")
    await owners.remember("acme", "resp_new1")
    assert (tmp_path / "responses" / tenant_key("acme") / "resp_new1").is_file()
    await owners.remember("acme", "-resp_2")  # any id the API takes is a key
    assert await owners.owns("acme", "-resp_2")


@pytest.mark.parametrize("key", ["", "../x", "a/../b", "/abs", ".hidden", "a//b", "a b"])
async def test_a_directory_store_refuses_keys_outside_it(tmp_path: Path, key: str) -> None:
    store: NamespacedStore = DirectoryStore(tmp_path / "s")
    with pytest.raises(ValueError):
        await store.set(key, b"1")
