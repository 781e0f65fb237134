"""Pool changes made through the admin API outlive the app that made them: the app
``semcache serve`` builds, over fake vLLM servers, started again on the same data dir; the
store's rules (the latest change of a server wins, joins before departures); and a store
that cannot take a change (503, nothing changed)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from litestar.testing import AsyncTestClient

from backends.config import VllmBackendConfig, VllmServer
from backends.vllm.client import VllmClient
from harness.fake_vllm import FakeServer
from harness.ports import free_port
from server.app import create_app, registry_from_config
from server.config import GatewayConfig, ModelEntry
from server.identity.api_keys.settings import KeySettings
from server.identity.auth import AuthSettings, TokenEntry
from server.pools.records import MemberChange
from server.pools.settings import MembershipSettings
from server.pools.store import LocalMembershipStore
from server.pools.sync import PoolMembership

ADMIN = {"authorization": "Bearer tok-ops"}
SERVERS = "/admin/backends/tiny/both/servers"
CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def answer(request: web.Request) -> web.StreamResponse:
    if request.method == "POST":
        return web.json_response({"choices": [{"message": {"content": request.url.host}}]})
    return web.json_response({})


@pytest.fixture
async def fakes() -> AsyncIterator[list[str]]:
    servers = [FakeServer(answer) for _ in range(2)]
    for server in servers:
        await server.start()
    yield [s.url for s in servers]
    for server in servers:
        await server.stop()


def config(data_dir: Path, url: str, **settings: Any) -> GatewayConfig:
    return GatewayConfig(
        **settings,
        data_dir=str(data_dir),
        cache=False,
        auth=AuthSettings(tokens=[TokenEntry(token="tok-ops", tenant="ops", roles=["admin"])]),
        models=[ModelEntry(id="tiny-chat", backend="tiny")],
        backends=[
            VllmBackendConfig(
                name="tiny",
                served_model="tiny",
                revision="pinned",
                servers=[VllmServer(url=url)],
                health_interval_s=3600,
                scrape_metrics=False,
            )
        ],
    )


async def test_a_restarted_app_serves_the_pools_as_the_admin_api_left_them(
    tmp_path: Path, fakes: list[str]
) -> None:
    first, second = fakes
    dead = f"http://127.0.0.1:{free_port()}"
    async with AsyncTestClient(create_app(config(tmp_path, first))) as http:
        added = await http.post(SERVERS, json={"url": second, "max_inflight": 3}, headers=ADMIN)
        assert added.status_code == 200, added.text
        assert (await http.post(SERVERS, json={"url": dead}, headers=ADMIN)).status_code == 200
        drained = await http.delete(SERVERS, params={"url": first}, headers=ADMIN)
        assert drained.json() == {"url": first, "drained": True, "inflight": 0}
        gone = await http.delete(SERVERS, params={"url": dead}, headers=ADMIN)
        assert gone.status_code == 200
    stored = (tmp_path / "pools" / "membership.json").read_bytes()
    assert second.encode() in stored and first.encode() in stored

    # the same config, started again: the first server stays out, the added one serves
    again = create_app(config(tmp_path, first))
    async with AsyncTestClient(again) as http:
        pools = (await http.get("/admin/backends", headers=ADMIN)).json()["data"]
        assert [(s["url"], s["state"], s["limit"]) for s in pools[0]["servers"]] == [
            (second, "serving", 3)
        ]
        assert again.state.membership.applied == 2  # second added, first drained

    # off: a restart serves the config's servers
    off = create_app(config(tmp_path, first, pools=MembershipSettings(storage="off")))
    async with AsyncTestClient(off) as http:
        pools = (await http.get("/admin/backends", headers=ADMIN)).json()["data"]
        assert [s["url"] for s in pools[0]["servers"]] == [first]


async def test_a_store_that_cannot_take_the_change_is_a_503_and_nothing_changed(
    tmp_path: Path, fakes: list[str]
) -> None:
    first, second = fakes
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[tiers.redis]\nurl = "redis://127.0.0.1:{free_port()}/0"\n')
    settings = config(tmp_path, first, policy=str(policy), keys=KeySettings(enabled=False))
    app = create_app(settings)  # nothing listens at the policy's Redis
    async with AsyncTestClient(app) as http:
        added = await http.post(SERVERS, json={"url": second}, headers=ADMIN)
        assert added.status_code == 503, added.text
        error = added.json()["error"]
        assert error["code"] == "membership_not_saved" and "was not added" in error["message"]
        pools = (await http.get("/admin/backends", headers=ADMIN)).json()["data"]
        assert [s["url"] for s in pools[0]["servers"]] == [first]
        assert (await http.post(SERVERS, json={"url": second}, headers=ADMIN)).status_code == 503


def change(url: str, state: str, at: float) -> MemberChange:
    return MemberChange(backend="tiny", role="both", url=url, state=state, at=at)  # type: ignore[arg-type]


async def test_the_latest_change_of_a_server_wins_and_joins_come_before_departures(
    tmp_path: Path, fakes: list[str]
) -> None:
    first, second = fakes
    store = LocalMembershipStore(tmp_path / "m.json")
    await store.put(change(second, "added", 1.0))
    await store.put(change(second, "drained", 2.0))
    await store.put(change(second, "added", 3.0))  # back again
    # the config's only server leaves: stored before the join, applied after it
    await store.put(change(first, "drained", 0.5))
    assert [(c.url, c.state) for c in sorted(await store.load_all(), key=lambda c: c.at)] == [
        (first, "drained"),
        (second, "added"),
    ]
    registry = registry_from_config(config(tmp_path, first))
    client = registry.generation["tiny"]
    assert isinstance(client, VllmClient)
    membership = PoolMembership(store, registry)
    try:
        await membership.sync()
        pool = client.pool("both")
        assert pool is not None and [s.url for s in pool.servers] == [second]
        await membership.sync()  # nothing differs: nothing applied again
        assert membership.applied == 2
        await store.put(change(second, "drained", 4.0))  # the last server: it stays
        await membership.sync()
        assert [s.url for s in pool.servers] == [second] and membership.applied == 2
        # a change for a pool this gateway does not have is skipped
        await store.put(MemberChange(backend="nope", role="both", url=first, state="added", at=5.0))
        await membership.sync()
        assert membership.applied == 2
    finally:
        await membership.aclose()
        await registry.aclose()
