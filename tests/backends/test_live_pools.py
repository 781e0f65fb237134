"""Servers joining and leaving pools while they serve, without vLLM: the pool mechanics, the
P/D client over fake servers (``harness.fake_vllm``), and the admin API of the app
``semcache serve`` builds. Real vLLM under load: ``test_live_pools_vllm.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from litestar.testing import AsyncTestClient
from prometheus_client.parser import text_string_to_metric_families

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.placement import RouteKey
from backends.fleet.pool_signals import pool_signals
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import parse_upstream_metrics
from backends.vllm.client import VllmClient
from foundation.request import RequestContext
from harness.fake_vllm import FakeServer
from server.app import create_app
from server.config import GatewayConfig, ModelEntry
from server.identity.auth import AuthSettings, TokenEntry
from tests.backends.pools import make_pool

LONG = "The cat reads a book near the window. " * 40
CHAT = "/v1/chat/completions"
ADMIN = {"authorization": "Bearer tok-ops"}


def decode_server(url: str, limit: int = 1) -> ServerState:
    return ServerState(VllmServer(url=url, role="decode"), limit=limit)


async def test_an_added_server_serves_a_waiting_request() -> None:
    pool = make_pool([1], max_queue=4)
    first = await pool.admission.acquire(lambda: pool.servers)
    waiting = asyncio.create_task(pool.admission.acquire(lambda: pool.servers))
    await asyncio.sleep(0)
    assert pool.admission.waiting == 1
    pool.add(decode_server("http://127.0.0.1:9100"))
    second = await waiting
    assert second.server.url == "http://127.0.0.1:9100"
    first.release()
    second.release()


async def test_a_drained_server_takes_nothing_new_and_leaves_when_its_requests_end() -> None:
    pool = make_pool([2, 2])
    a, b = pool.servers
    running = await pool.admission.acquire(lambda: [a])
    pool.drain(a)
    assert pool.servers == [b] and pool.leaving() == [a]
    leases = [await pool.admission.acquire(lambda: pool.servers) for _ in range(2)]
    assert {lease.server.url for lease in leases} == {b.url}
    assert not await pool.wait_drained(a, timeout_s=0.01)  # its request still runs
    waiter = asyncio.create_task(pool.wait_drained(a, timeout_s=5))
    await asyncio.sleep(0)
    assert not waiter.done()
    running.release()
    assert await waiter
    assert pool.leaving() == [] and a.inflight == 0
    for lease in leases:
        lease.release()


async def test_draining_the_last_free_server_refuses_the_waiters() -> None:
    pool = make_pool([1], max_queue=4)
    (a,) = pool.servers
    held = await pool.admission.acquire(lambda: pool.servers)
    waiting = asyncio.create_task(pool.admission.acquire(lambda: pool.servers))
    await asyncio.sleep(0)
    pool.drain(a)
    with pytest.raises(Exception, match="no healthy decode server"):
        await waiting
    held.release()
    assert await pool.wait_drained(a, 1)


def test_add_refuses_the_wrong_role_a_duplicate_and_a_draining_server() -> None:
    pool = make_pool([1, 1])
    a, _ = pool.servers
    with pytest.raises(ValueError, match="cannot join"):
        pool.add(ServerState(VllmServer(url="http://127.0.0.1:1", role="prefill"), limit=1))
    with pytest.raises(ValueError, match="already serves"):
        pool.add(decode_server(a.url + "/"))
    a.inflight = 1
    pool.drain(a)
    with pytest.raises(ValueError, match="still draining"):
        pool.add(decode_server(a.url))
    a.inflight = 0
    pool.add(decode_server(a.url))  # it has left: it may come back


def test_signals_sum_the_scraped_queues_and_average_recent_ttft() -> None:
    pool = make_pool([4, 4])
    a, b = pool.servers

    def page(waiting: int, kv: float, ttft_sum: float, ttft_count: int) -> str:
        return (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0"}} {kv}\n'
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf"}} {ttft_count}\n'
            f'vllm:time_to_first_token_seconds_count{{engine="0"}} {ttft_count}\n'
            f'vllm:time_to_first_token_seconds_sum{{engine="0"}} {ttft_sum}\n'
        )

    a.previous_upstream = parse_upstream_metrics(page(0, 0.1, 1.0, 10))
    a.upstream = parse_upstream_metrics(page(3, 0.5, 4.0, 13))  # 3 requests, 1 s each
    b.previous_upstream = parse_upstream_metrics(page(0, 0.1, 2.0, 10))
    b.upstream = parse_upstream_metrics(page(1, 0.9, 2.0, 10))  # none finished
    pool.admission.waiting = 2
    sig = pool_signals(pool)
    assert (sig.vllm_waiting, sig.queue_depth) == (4, 6)
    assert sig.kv_cache_usage == pytest.approx(0.7)
    assert sig.kv_cache_usage_max == pytest.approx(0.9)
    assert (sig.ttft.sum, sig.ttft.count) == (6.0, 23)
    assert sig.recent_ttft_s == pytest.approx(1.0)
    assert sig.recent_queue_time_s is None  # not scraped
    assert (sig.serving, sig.limit) == (2, 8)


# -- the P/D client over fake servers ---------------------------------------------------------


class Fakes:
    """Fake vLLM servers: a prefill answer with KV parameters, a decode answer that waits for
    ``release`` when ``hold`` is set; each records the requests it got."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.hold = False
        self.release = asyncio.Event()
        self.arrived = asyncio.Condition()
        self.servers: dict[str, FakeServer] = {}

    def handler(self, name: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            if request.path != CHAT:
                return web.Response(status=200)
            self.seen[name] = self.seen.get(name, 0) + 1
            async with self.arrived:
                self.arrived.notify_all()
            body = orjson.loads(await request.read())
            if body.get("kv_transfer_params", {}).get("do_remote_decode"):
                payload: dict[str, Any] = {"choices": [], "kv_transfer_params": {"x": 1}}
            else:
                if self.hold:
                    await self.release.wait()
                payload = {"choices": [{"message": {"content": "Hi"}}]}
            return web.json_response(payload)

        return handle

    async def start(self, name: str) -> str:
        server = FakeServer(self.handler(name))
        await server.start()
        self.servers[name] = server
        return server.url


@pytest.fixture
async def fakes() -> AsyncIterator[Fakes]:
    made = Fakes()
    yield made
    made.release.set()
    for server in made.servers.values():
        await server.stop()


def ctx() -> RequestContext:
    return RequestContext(request_id="r", tenant="key:a", salt_scope="key:a")


def chat() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": LONG}]}


async def test_a_prefill_server_added_to_an_empty_pool_takes_the_prefill_hops(
    fakes: Fakes,
) -> None:
    decode = await fakes.start("d1")
    config = VllmBackendConfig(
        name="t",
        served_model="m",
        servers=[VllmServer(url=decode, role="decode")],
        prefill_threshold_tokens=64,
        health_interval_s=3600,
        cache_salt=False,
    )
    client = VllmClient(config)
    try:
        assert (await client.post(CHAT, chat(), ctx())).status == 200
        assert fakes.seen == {"d1": 1}
        assert client.stats.prefill_skipped == {}  # no prefill pool is no skip
        server = await client.add_server("prefill", await fakes.start("p1"))
        assert server.healthy
        assert (await client.post(CHAT, chat(), ctx())).status == 200
        assert fakes.seen == {"d1": 2, "p1": 1} and server.requests == 1
        pool, drained = client.drain_server("prefill", server.url)
        assert await pool.wait_drained(drained, 1)
        assert (await client.post(CHAT, chat(), ctx())).status == 200
        assert fakes.seen == {"d1": 3, "p1": 1}  # the last prefill server may leave
    finally:
        await client.aclose()


async def test_a_drained_decode_server_finishes_its_requests_there(fakes: Fakes) -> None:
    urls = [await fakes.start("d1"), await fakes.start("d2")]
    config = VllmBackendConfig(
        name="t",
        served_model="m",
        servers=[VllmServer(url=u, role="decode") for u in urls],
        health_interval_s=3600,
        cache_salt=False,
    )
    client = VllmClient(config)
    try:
        fakes.hold = True
        running = [asyncio.create_task(client.post(CHAT, chat(), ctx())) for _ in range(4)]
        async with fakes.arrived:
            await fakes.arrived.wait_for(lambda: sum(fakes.seen.values()) == 4)
        d1 = client.decode_pool.servers[0]
        held = d1.inflight
        assert held == fakes.seen["d1"] > 0
        pool, server = client.drain_server("decode", urls[0])
        with pytest.raises(ValueError, match="last decode server"):
            client.drain_server("decode", urls[1])
        assert client.drain_server("decode", urls[0]) == (pool, server)  # it drains already
        with pytest.raises(LookupError):
            client.drain_server("decode", "http://127.0.0.1:9")
        fakes.hold = False
        more = [await client.post(CHAT, chat(), ctx()) for _ in range(3)]
        assert fakes.seen == {"d1": held, "d2": 7 - held}  # nothing new on the draining one
        assert server.inflight == held and not await pool.wait_drained(server, 0.01)
        fakes.release.set()
        answers = await asyncio.gather(*running)
        assert [a.status for a in [*answers, *more]] == [200] * 7
        assert await pool.wait_drained(server, 1) and server.inflight == 0
        assert pool.leaving() == []
        assert client.router.placement.rank(pool.servers, RouteKey()) == [pool.servers[0]]
    finally:
        await client.aclose()


# -- the admin API of the app ------------------------------------------------------------------


def _app(tmp_path: Path, urls: dict[str, list[str]]) -> Any:
    servers = [VllmServer(url=u, role=role) for role, us in urls.items() for u in us]  # type: ignore[arg-type]
    config = GatewayConfig(
        data_dir=str(tmp_path),
        cache=False,
        auth=AuthSettings(tokens=[TokenEntry(token="tok-ops", tenant="ops", roles=["admin"])]),
        models=[ModelEntry(id="tiny-chat", backend="tiny")],
        backends=[
            VllmBackendConfig(
                name="tiny",
                served_model="tiny",
                revision="pinned",
                servers=servers,
                health_interval_s=3600,
                max_inflight_per_server=4,
            )
        ],
    )
    return create_app(config)


async def test_admin_api_adds_lists_and_drains_servers(tmp_path: Path, fakes: Fakes) -> None:
    decode = await fakes.start("d1")
    prefill = await fakes.start("p1")
    app = _app(tmp_path, {"decode": [decode]})
    async with AsyncTestClient(app) as http:
        pools = (await http.get("/admin/backends", headers=ADMIN)).json()["data"]
        assert [(p["role"], len(p["servers"])) for p in pools] == [("prefill", 0), ("decode", 1)]
        assert pools[1]["signals"]["serving"] == 1 and pools[1]["signals"]["limit"] == 4
        assert (await http.get("/admin/backends")).status_code == 401

        added = await http.post(
            "/admin/backends/tiny/prefill/servers", json={"url": prefill}, headers=ADMIN
        )
        assert added.status_code == 200, added.text
        assert added.json()["state"] == "serving" and added.json()["limit"] == 4
        again = await http.post(
            "/admin/backends/tiny/prefill/servers", json={"url": prefill}, headers=ADMIN
        )
        assert again.status_code == 409
        bad = await http.post(
            "/admin/backends/tiny/prefill/servers", json={"url": "x"}, headers=ADMIN
        )
        assert bad.status_code == 400
        down = await http.post(
            "/admin/backends/tiny/decode/servers",
            json={"url": "http://127.0.0.1:9", "max_inflight": 2},
            headers=ADMIN,
        )
        assert down.json()["state"] == "ejected"  # nothing listens: it joins ejected
        for path in ("nope/decode", "tiny/both"):
            missing = await http.post(
                f"/admin/backends/{path}/servers", json={"url": prefill}, headers=ADMIN
            )
            assert missing.status_code == 404

        page = (await http.get("/metrics")).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page)
            for s in family.samples
        }
        serving = (("backend", "tiny"), ("role", "prefill"), ("state", "serving"))
        assert samples[("semcache_pool_servers", serving)] == 1
        assert samples[("semcache_pool_limit", (("backend", "tiny"), ("role", "decode")))] == 4

        drained = await http.delete(
            "/admin/backends/tiny/prefill/servers", params={"url": prefill}, headers=ADMIN
        )
        assert drained.json() == {"url": prefill, "drained": True, "inflight": 0}
        gone = await http.delete(
            "/admin/backends/tiny/prefill/servers", params={"url": prefill}, headers=ADMIN
        )
        assert gone.status_code == 404
        await http.delete(
            "/admin/backends/tiny/decode/servers",
            params={"url": "http://127.0.0.1:9"},
            headers=ADMIN,
        )
        last = await http.delete(
            "/admin/backends/tiny/decode/servers", params={"url": decode}, headers=ADMIN
        )
        assert last.status_code == 409
        pools = (await http.get("/admin/backends", headers=ADMIN)).json()["data"]
        assert [[s["url"] for s in p["servers"]] for p in pools] == [[], [decode]]
