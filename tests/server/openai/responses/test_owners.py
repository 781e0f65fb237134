"""The owners of stored responses (local disk, Redis, a Redis Cluster): a tenant owns only the
ids it made, every gateway on one storage knows them, and on Redis they expire with the
files' retention period."""

from __future__ import annotations

from tests.server.openai.conftest import StoresFactory


async def test_a_response_is_owned_by_its_tenant_on_every_gateway_of_one_storage(
    make_stores: StoresFactory,
) -> None:
    one, two = make_stores(retention_s=600.0), make_stores(retention_s=600.0)
    await one.responses.remember("acme", "resp_abc123")
    assert await two.responses.owns("acme", "resp_abc123")
    assert not await two.responses.owns("other", "resp_abc123")
    assert not await two.responses.owns("acme", "resp_unknown")
    await one.responses.remember("acme", "../resp_x")  # not an id: nothing is written
    assert not await two.responses.owns("acme", "../resp_x")
    if one.redis is not None:
        keys = [k async for k in one.redis.scan_iter(f"{one.prefix}:*resp:*")]
        assert len(keys) == 1
        assert 590_000 < await one.redis.pttl(keys[0]) <= 600_000
