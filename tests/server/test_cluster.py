"""Several hosts, one machine: what must hold when the gateways, Redis, prefill and decode
run on hosts of their own (``harness/cluster/``: network namespaces on a bridge).

One cluster for the module (HAProxy, two gateways, the shared tier as a Redis Cluster of
three primaries with two replicas each on three hosts, one prefill and one decode vLLM of the
tiny Llama, the KV crossing the veth over UCX/TCP). The tests run in file order: the
later ones stop hosts, the last ones for good. Without root, ``ip netns``, haproxy or
redis-server the module is skipped and says which is missing.

``SEMCACHE_TEST_CLUSTER_KEEP=1`` leaves the cluster up afterwards (and a running one is
reused): a developer speed-up; ``scripts/cluster.sh down`` removes it.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from harness.cluster import (
    HOST_HEADER,
    METERED_RPM,
    METERED_TOKEN,
    MODEL_ID,
    SEMANTIC_MODEL_ID,
    TOKEN,
    WORKERS_AI_MODEL,
    Cluster,
    missing_requirements,
)
from harness.fleet_load import KINDS, FleetLoad
from harness.metrics import metric_value
from tests.support.waiting import wait_until_async

MISSING = missing_requirements()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the first test pays for the cluster's start
    pytest.mark.skipif(bool(MISSING), reason="no cluster here, missing: " + ", ".join(MISSING)),
]

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TIMEOUT_S = 120.0  # every request is bounded: a hang fails the test instead of stalling it
SENTENCE = "The cat reads a book near the window. "


def chat(prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def unique(words: int = 3) -> str:
    """A short prompt no earlier run asked (the tiny tokenizer knows these words)."""
    return f"Story {uuid.uuid4().hex}. " + SENTENCE * words


async def ask(
    client: httpx.AsyncClient, base: str, body: dict[str, Any], **headers: str
) -> httpx.Response:
    return await client.post(
        f"{base}/v1/chat/completions", json=body, headers={**AUTH, **headers}, timeout=TIMEOUT_S
    )


def cache_status(response: httpx.Response) -> str:
    return response.headers.get("cf-aig-cache-status", "")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(cache_cluster=True)
    began = time.monotonic()
    c.up()
    print(f"cluster up in {time.monotonic() - began:.0f} s")
    # The first NIXL hand-off between two servers also makes their handshake: warm it up.
    httpx.post(
        f"{c.gateway_url('gw1')}/v1/chat/completions",
        json=chat(unique(60), 1),
        headers=AUTH,
        timeout=TIMEOUT_S,
    )
    try:
        yield c
    finally:
        if not os.environ.get("SEMCACHE_TEST_CLUSTER_KEEP"):
            c.down()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as c:
        yield c


async def settled(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """A vLLM counter once it stops moving (it is updated just after the answer)."""
    last = await metric_value(url, name, labels)
    for _ in range(40):
        await asyncio.sleep(0.25)
        now = await metric_value(url, name, labels)
        if now == last:
            return now
        last = now
    return last


# -- the KV crosses the network ---------------------------------------------------------------


async def test_decode_pulls_the_prompt_from_the_prefill_host_over_tcp(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    decode = cluster.vllm_url("d1")
    local = {"source": "local_compute"}
    external = await settled(decode, "vllm:external_prefix_cache_hits_total")
    computed = await settled(decode, "vllm:prompt_tokens_by_source_total", local)
    r = await ask(client, cluster.lb_url, chat(unique(50)))
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 400
    assert await settled(decode, "vllm:external_prefix_cache_hits_total") - external == (
        prompt_tokens
    )
    assert await settled(decode, "vllm:prompt_tokens_by_source_total", local) == computed
    # UCX's protocol table in the decode log: the KV read (ucp_get) went over TCP on eth0.
    log = cluster.current_log("d1")
    reads = log.split("remote memory read by ucp_get")[1:]
    assert reads, "UCX logged no remote read"
    assert all("tcp/eth0" in block[:600] for block in reads)


# -- the shared tier: one cache across the gateways --------------------------------------------


async def test_an_answer_stored_through_gw1_is_a_hit_through_gw2(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body = chat(unique())
    first = await ask(client, cluster.gateway_url("gw1"), body)
    assert first.status_code == 200, first.text
    assert cache_status(first) == "MISS"
    second = await ask(client, cluster.gateway_url("gw2"), body)
    assert second.status_code == 200, second.text
    assert cache_status(second) == "HIT"
    assert second.json()["choices"] == first.json()["choices"]


async def test_a_purge_on_gw2_stops_gw1_at_once(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    gw1, gw2 = cluster.gateway_url("gw1"), cluster.gateway_url("gw2")
    body = chat(unique())
    stored = await ask(client, gw1, body)
    assert cache_status(stored) == "MISS"
    assert cache_status(await ask(client, gw1, body)) == "HIT"  # now in gw1's local tiers too
    purge = await client.post(
        f"{gw2}/admin/cache/purge",
        json={"kind": "key", "target": stored.headers["x-semcache-key"]},
        headers=AUTH,
    )
    assert purge.status_code == 200, purge.text
    after = await ask(client, gw1, body)
    assert after.status_code == 200
    assert cache_status(after) == "MISS"


BATCH_PATH = f"/client/v4/accounts/acc/ai/run/{WORKERS_AI_MODEL}"


async def submit_batch(client: httpx.AsyncClient, cluster: Cluster, items: int, to: str) -> str:
    """A Workers-AI batch sent through the LB to gateway ``to``; its request id."""
    requests = [
        {"prompt": unique(), "max_tokens": 4, "external_reference": f"r{i}"} for i in range(items)
    ]
    submitted = await client.post(
        f"{cluster.lb_url}{BATCH_PATH}?queueRequest=true",
        json={"requests": requests},
        headers={**AUTH, HOST_HEADER: to},
    )
    assert submitted.status_code == 200, submitted.text
    assert submitted.headers[HOST_HEADER] == to
    return str(submitted.json()["result"]["request_id"])


async def poll_batch(
    client: httpx.AsyncClient, base: str, request_id: str, timeout_s: float = 120.0
) -> list[dict[str, Any]]:
    """Poll until the batch has its results; they must be exactly one per item, all good."""
    deadline = time.monotonic() + timeout_s
    while True:
        polled = await client.post(
            f"{base}{BATCH_PATH}", json={"request_id": request_id}, headers=AUTH
        )
        assert polled.status_code == 200, polled.text
        result = polled.json()["result"]
        if "responses" in result:
            break
        assert result["status"] in ("queued", "running")
        assert time.monotonic() < deadline, f"the batch did not finish in {timeout_s} s"
        await asyncio.sleep(0.5)
    responses: list[dict[str, Any]] = sorted(result["responses"], key=lambda r: r["id"])
    assert [r["id"] for r in responses] == list(range(len(responses)))
    assert all(r["success"] for r in responses), responses
    assert [r["external_reference"] for r in responses] == [f"r{i}" for i in range(len(responses))]
    return responses


async def test_a_batch_submitted_through_the_lb_to_gw1_is_polled_through_gw2(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    request_id = await submit_batch(client, cluster, 4, to="gw1")
    responses = await poll_batch(client, cluster.gateway_url("gw2"), request_id)
    assert len(responses) == 4


# -- hosts that stop ----------------------------------------------------------------------------


async def test_the_cache_tier_stops_and_comes_back(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    gateways = [cluster.gateway_url(gw) for gw in ("gw1", "gw2")]
    known = chat(unique())
    for gw in gateways:  # stored by gw1, then in gw2's local tiers as well
        assert (await ask(client, gw, known)).status_code == 200
    # Its hosts vanish (their links go down): Redis calls time out rather than being refused.
    for host in cluster.cache_hosts:
        await asyncio.to_thread(cluster.unplug, host)
    try:
        for gw in gateways:
            began = time.monotonic()
            hit = await ask(client, gw, known)
            assert hit.status_code == 200, hit.text
            assert cache_status(hit) == "HIT"  # from the gateway's own tiers
            fresh = await ask(client, gw, chat(unique()))
            assert fresh.status_code == 200, fresh.text
            assert time.monotonic() - began < 20
    finally:
        for host in cluster.cache_hosts:
            await asyncio.to_thread(cluster.plug, host)
    # Its nodes saw each other vanish too: each counts the others failed until it hears from
    # them again, and answers CLUSTERDOWN meanwhile. The next tests need every slot served.
    print(f"the cache cluster was ok again {await asyncio.to_thread(cluster.wait_cache_ok):.1f} s")
    # The shared tier resumes: once the gateways have reconnected, gw1's answers hit on gw2.
    deadline = time.monotonic() + 60
    while True:
        body = chat(unique())
        assert (await ask(client, gateways[0], body)).status_code == 200
        again = await ask(client, gateways[1], body)
        assert again.status_code == 200, again.text
        if cache_status(again) == "HIT":
            break
        assert time.monotonic() < deadline, "the shared tier did not resume within 60 s"
        await asyncio.sleep(0.5)


async def test_a_semantic_entry_made_on_gw1_serves_on_gw2(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    tag = uuid.uuid4().hex[:8]
    question = f"What is the capital of France, {tag}?"
    near = f"what is the capital of france, {tag}!"  # a near-duplicate (other case, mark)
    first = await ask(
        client, cluster.gateway_url("gw1"), {**chat(question), "model": SEMANTIC_MODEL_ID}
    )
    assert first.status_code == 200, first.text
    # The entry reaches gw2's index through the Redis stream; until then gw2 misses, and
    # `no-store` keeps those misses from making entries of their own.
    deadline = time.monotonic() + 30
    while True:
        hit = await ask(
            client,
            cluster.gateway_url("gw2"),
            {**chat(near), "model": SEMANTIC_MODEL_ID},
            **{"cache-control": "no-store"},
        )
        assert hit.status_code == 200, hit.text
        if hit.headers.get("x-semcache-semantic") == "hit":
            break
        assert time.monotonic() < deadline, "gw1's semantic entry never served on gw2"
        await asyncio.sleep(0.5)
    assert hit.json()["id"] == first.json()["id"]  # gw1's answer


async def test_rate_limits_and_the_ledger_count_once_across_both_gateways(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The metered token's requests alternate between gw1 and gw2: the shared window (in the
    Redis host) admits exactly its limit in all, and both gateways' usage reads say the same."""
    metered = {"Authorization": f"Bearer {METERED_TOKEN}"}
    day = time.strftime("%Y-%m-%d", time.gmtime())
    # Read by the admin (every authenticated request takes from its token's window).
    usage_query = {"start": day, "end": day, "group_by": "", "tenant": "metered"}

    async def requests_counted(host: str) -> int:
        r = await client.get(
            f"{cluster.gateway_url(host)}/v1/usage", params=usage_query, headers=AUTH
        )
        assert r.status_code == 200, r.text
        rows = r.json()["data"]
        return int(rows[0]["requests"]) if rows else 0

    before = await requests_counted("gw1")  # a kept cluster's Redis may hold earlier runs
    body = chat(unique())
    statuses: dict[str, list[int]] = {"gw1": [], "gw2": []}
    for i in range(METERED_RPM + 4):  # within one minute: hits after the first answer
        host = ("gw1", "gw2")[i % 2]
        r = await client.post(
            f"{cluster.gateway_url(host)}/v1/chat/completions",
            json=body,
            headers=metered,
            timeout=TIMEOUT_S,
        )
        statuses[host].append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            assert int(r.headers["retry-after"]) > 0
    every = statuses["gw1"] + statuses["gw2"]
    assert every.count(200) == METERED_RPM, statuses
    assert every.count(429) == 4, statuses
    assert 200 in statuses["gw1"] and 200 in statuses["gw2"], statuses

    # Each gateway flushes its sums to the Redis host every second: both read one total.
    deadline = time.monotonic() + 30
    while True:
        totals = [await requests_counted(host) - before for host in ("gw1", "gw2")]
        if totals == [METERED_RPM, METERED_RPM]:
            break
        assert time.monotonic() < deadline, f"usage never settled on both gateways: {totals}"
        await asyncio.sleep(0.5)


# -- state that outlives a gateway; a gateway cut off from the cache tier ----------------------

PREFILL_SERVERS = "/admin/backends/tiny/prefill/servers"


async def pool_servers(client: httpx.AsyncClient, base: str, role: str) -> list[tuple[str, str]]:
    """The (url, state) of each server of ``base``'s ``role`` pool, as its admin API lists."""
    r = await client.get(f"{base}/admin/backends", headers=AUTH)
    assert r.status_code == 200, r.text
    pools = [p for p in r.json()["data"] if p["role"] == role]
    return [(s["url"], s["state"]) for p in pools for s in p["servers"]]


async def prefill_servers(client: httpx.AsyncClient, base: str) -> list[tuple[str, str]]:
    return await pool_servers(client, base, "prefill")


async def test_a_pool_changed_on_gw1_is_changed_on_gw2_and_after_gw2_is_killed(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The pool membership store is the Redis host: a drain made through gw1 reaches gw2 at
    once, and a gw2 killed (-9) and started again comes back with the pool as it was."""
    gw1, gw2, p1 = cluster.gateway_url("gw1"), cluster.gateway_url("gw2"), cluster.vllm_url("p1")
    drained = await client.delete(f"{gw1}{PREFILL_SERVERS}", params={"url": p1}, headers=AUTH)
    assert drained.status_code == 200 and drained.json()["drained"], drained.text
    try:
        # the drain reached gw2
        await wait_until_async(lambda: _empty(client, gw2), timeout_s=2.0, interval_s=0.1)
        await asyncio.to_thread(cluster.kill, "gw2")
        await asyncio.to_thread(cluster.start, "gw2")
        assert await prefill_servers(client, gw2) == []
        r = await ask(client, gw2, chat(unique(50)))  # long: decode computes it alone
        assert r.status_code == 200, r.text
    finally:  # p1 joins again, through the gateway that was restarted
        added = await client.post(f"{gw2}{PREFILL_SERVERS}", json={"url": p1}, headers=AUTH)
        assert added.status_code == 200, added.text
    # p1's return reached gw1 through the store
    await wait_until_async(lambda: _serving(client, gw1, p1), timeout_s=5.0, interval_s=0.1)
    await asyncio.to_thread(cluster.wait_lb, 2)


async def _empty(client: httpx.AsyncClient, base: str) -> bool:
    return await prefill_servers(client, base) == []


async def _serving(client: httpx.AsyncClient, base: str, url: str) -> bool:
    return await prefill_servers(client, base) == [(url, "serving")]


async def test_gw1_cut_off_from_the_cache_tier_answers_everything_in_bounded_time(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """A partition between one gateway and the cache tier (the other gateway still reaches
    it): gw1 answers hits and misses from its own tiers and vLLM, no 5xx, no hang; once the
    partition heals its answers reach the shared tier again."""
    gw1, gw2 = cluster.gateway_url("gw1"), cluster.gateway_url("gw2")
    known = chat(unique())
    assert (await ask(client, gw1, known)).status_code == 200  # in gw1's own tiers too
    for host in cluster.cache_hosts:
        await asyncio.to_thread(cluster.partition, "gw1", host)
    slowest = 0.0
    try:
        for i in range(6):
            body = known if i % 2 else chat(unique())
            began = time.monotonic()
            r = await ask(client, gw1, body)
            slowest = max(slowest, time.monotonic() - began)
            assert r.status_code == 200, r.text
            if body is known:
                assert cache_status(r) == "HIT"
        served = await ask(client, gw2, chat(unique()))  # the other side is unaffected
        assert served.status_code == 200, served.text
    finally:
        for host in cluster.cache_hosts:
            await asyncio.to_thread(cluster.heal, "gw1", host)
    print(f"slowest answer of gw1 while cut off from the cache tier: {slowest:.2f} s")
    assert slowest < 20
    deadline = time.monotonic() + 60
    while True:  # the link comes back by itself
        body = chat(unique())
        assert (await ask(client, gw1, body)).status_code == 200
        again = await ask(client, gw2, body)
        assert again.status_code == 200, again.text
        if cache_status(again) == "HIT":
            break
        assert time.monotonic() < deadline, "gw1 did not reach the shared tier again in 60 s"
        await asyncio.sleep(0.5)


SLOW_LINK_LOAD_S = 12.0
SLOW_LINK_MORE_S = 60.0
"""How much longer the load may run, past ``SLOW_LINK_LOAD_S``, for every kind to be answered."""
HAS_TUN = os.path.exists("/dev/net/tun")
"""``harness.netem`` carries the impaired link through a TUN device."""


@pytest.mark.skipif(not HAS_TUN, reason="no /dev/net/tun for harness.netem")
async def test_a_slow_lossy_link_to_the_cache_tier_slows_gw1_and_fails_nothing(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """200 ms each way and 5 % of packets lost between gw1 and every cache host (what
    ``tc netem`` would do, made in user space by ``Cluster.impair``), under the mixed load sent
    to gw1 alone: slower, but no request is refused or fails, none hangs, nothing is lost."""
    load = FleetLoad(
        cluster.gateway_url("gw1"), TOKEN, model=MODEL_ID, workers_ai_model=WORKERS_AI_MODEL
    )
    await load.prepare(client)
    stop = asyncio.Event()
    await asyncio.to_thread(cluster.impair, "gw1", cluster.cache_hosts, 200.0, 0.05)
    try:
        running = asyncio.create_task(load.run(stop))
        try:
            await asyncio.sleep(SLOW_LINK_LOAD_S)
            # Each request crosses the slow link several times: on a loaded machine the time
            # may pass before every kind has been answered once, so the load goes on until it has.
            await wait_until_async(
                lambda: {o.kind for o in load.outcomes} >= set(KINDS),
                timeout_s=SLOW_LINK_MORE_S,
                interval_s=0.2,
            )
        finally:
            stop.set()
            await running
    finally:
        await asyncio.to_thread(cluster.repair, "gw1", cluster.cache_hosts)
    found = await load.check(client)
    slowest = max(o.ended - o.began for o in load.outcomes)
    kinds = {k: sum(o.kind == k for o in load.outcomes) for k in KINDS}
    carried = cluster.current_log("netem-gw1").strip().splitlines()[-1]
    print(f"{len(load.outcomes)} requests {kinds}, slowest {slowest:.1f} s; {found}; {carried}")
    assert "dropped 0" not in carried, carried  # the link did lose packets
    assert not load.failed() and not load.retried(), load.retried()
    assert slowest < 20.0
    assert found.items_lost == 0 and found.files_lost == 0 and found.wrong == 0, found
    assert all(kinds[k] > 0 for k in KINDS), kinds


QUEUE_KEY = "{semcache:batch}:items"
"""The batch queue's stream: the primary that holds it is the one killed."""
FAILOVER_WINDOW_S = 10.0
"""After a cache primary is lost, how long requests may still need a retry: the replica is
promoted after ``cluster-node-timeout`` (2 s) and an election; the gateways' clients learn
the new slot map on their next redirect or refresh."""


async def test_kill_9_of_a_cache_primary_under_mixed_load_loses_nothing(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Hits, misses, streams, batch submits, uploads and purges through the LB while the
    primary holding the batch queue is killed (-9): its replica takes over; every request
    succeeds in the end (a retry where needed, none after the failover window), every batch
    item has exactly one result, every acknowledged file is there, no hit is wrong."""
    load = FleetLoad.through_lb(cluster)
    await load.prepare(client)
    victim = cluster.cache_primary(QUEUE_KEY)
    assert victim, "no primary serves the batch queue's slot"
    stop = asyncio.Event()
    running = asyncio.create_task(load.run(stop))
    try:
        await asyncio.sleep(3.0)  # steady load first
        killed_at = time.monotonic()
        await asyncio.to_thread(cluster.kill, victim)
        failover_s = await asyncio.to_thread(cluster.wait_failover, QUEUE_KEY, victim)
        await asyncio.sleep(FAILOVER_WINDOW_S + 5.0)  # and on, past the window
    finally:
        stop.set()
        await running
        await asyncio.to_thread(cluster.start, victim)  # it rejoins as a replica
    found = await load.check(client)
    late = load.retried(after=killed_at + FAILOVER_WINDOW_S)
    kinds = {k: sum(o.kind == k for o in load.outcomes) for k in KINDS}
    print(
        f"{victim} killed; a replica took over after {failover_s:.1f} s; "
        f"{len(load.outcomes)} requests {kinds}, {len(load.retried())} retried, "
        f"{len(load.failed())} failed; {found}"
    )
    assert not load.failed(), load.failed()
    assert not late, late
    assert found.items_lost == 0 and found.files_lost == 0 and found.wrong == 0, found
    assert found.batches > 0 and found.files > 0
    assert all(kinds[k] > 0 for k in KINDS), kinds
    await asyncio.to_thread(cluster.wait_cache_ok, 60.0)


KILL_GRACE_S = 0.5
"""How long after ``cluster.kill`` returns a request may still meet gw1's dying socket: the
kill returns once the process group is gone, which the harness learns by polling, and a
request HAProxy had already handed to gw1's socket by then fails with it."""


@dataclass
class Outcome:
    began: float
    ended: float
    status: int
    host: str


async def test_kill_9_of_gw1_under_load_loses_only_its_requests_in_flight(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    prompts = [chat(unique()) for _ in range(8)]
    for body in prompts:  # stored once; the load is hits, then misses of the same sizes
        assert (await ask(client, cluster.lb_url, body)).status_code == 200
    outcomes: list[Outcome] = []
    stop = asyncio.Event()

    async def worker(k: int) -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as own:
            for i in range(10_000):
                if stop.is_set():
                    return
                body = prompts[(k + i) % len(prompts)] if i % 4 else chat(unique())
                began = time.monotonic()
                try:
                    r = await ask(own, cluster.lb_url, body)
                    status, host = r.status_code, r.headers.get(HOST_HEADER, "")
                except httpx.HTTPError as exc:
                    status, host = 0, type(exc).__name__
                outcomes.append(Outcome(began, time.monotonic(), status, host))

    batch = await submit_batch(client, cluster, 6, to="gw1")  # its items run during the kill
    workers = [asyncio.create_task(worker(k)) for k in range(4)]
    killed = False
    try:
        while len({o.host for o in outcomes if o.status == 200}) < 2:  # both gateways serve
            assert len(outcomes) < 400, "the LB never used both gateways"
            await asyncio.sleep(0.05)
        killed_at = time.monotonic()
        killed = True
        await asyncio.to_thread(cluster.kill, "gw1")
        killed_done = time.monotonic() + KILL_GRACE_S
        while len([o for o in outcomes if o.began > killed_done]) < 20:
            assert time.monotonic() - killed_done < 60, "the load stalled after the kill"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*workers)
        if killed:
            restart = asyncio.create_task(asyncio.to_thread(cluster.start, "gw1"))
    try:
        failed = [o for o in outcomes if o.status != 200]
        print(f"{len(outcomes)} requests, {len(failed)} failed (in flight on gw1 at the kill)")
        for o in failed:
            print(
                f"  {o.began - killed_at:+.3f} .. {o.ended - killed_at:+.3f} s: {o.status} {o.host}"
            )
        # Only requests in flight at the kill may fail; they went to gw1 (gw2 answers all).
        assert all(o.began <= killed_done and o.ended >= killed_at for o in failed), failed
        assert len(failed) <= len(workers)
        after = [o for o in outcomes if o.began > killed_done]
        assert all(o.status == 200 and o.host == "gw2" for o in after)
        # Items gw1 had claimed return to the queue when their lease ends: one result each.
        assert len(await poll_batch(client, cluster.gateway_url("gw2"), batch)) == 6
    finally:
        await restart  # the next tests need both gateways


async def test_the_prefill_host_stops_and_decode_computes_alone(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    decode = cluster.vllm_url("d1")
    local = {"source": "local_compute"}
    await asyncio.to_thread(cluster.kill, "p1")  # its process dies: connections are refused
    computed = await settled(decode, "vllm:prompt_tokens_by_source_total", local)
    began = time.monotonic()
    r = await ask(client, cluster.lb_url, chat(unique(50)))
    assert r.status_code == 200, r.text
    assert time.monotonic() - began < 60
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert await settled(decode, "vllm:prompt_tokens_by_source_total", local) - computed == (
        prompt_tokens
    )


DECODE_SERVERS = "/admin/backends/tiny/decode/servers"


async def decode_serving(client: httpx.AsyncClient, base: str) -> set[str]:
    return {url for url, state in await pool_servers(client, base, "decode") if state == "serving"}


async def test_a_decode_host_killed_beside_a_second_one_fails_only_its_requests_in_flight(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """A second decode server (d2) joins through the admin API; under a load of new prompts
    through the LB, d1 is killed (-9): only requests in flight on it may fail, every later
    one is answered by d2, and every answer is the greedy answer asked before the fault."""
    gw1, gw2 = cluster.gateway_url("gw1"), cluster.gateway_url("gw2")
    d1, d2 = cluster.vllm_url("d1"), cluster.vllm_url("d2")
    await asyncio.to_thread(cluster.start, "d2")
    added = await client.post(f"{gw1}{DECODE_SERVERS}", json={"url": d2}, headers=AUTH)
    assert added.status_code == 200, added.text
    for gw in (gw1, gw2):  # the pool store carries it to gw2
        # until d2 serves there
        await wait_until_async(
            lambda gw=gw: _both(client, gw, {d1, d2}), timeout_s=10.0, interval_s=0.1
        )
    prompts = [unique() for _ in range(6)]
    fresh = {"cache-control": "no-store"}  # every request reaches vLLM
    expected = {}
    for text in prompts:
        r = await ask(client, cluster.lb_url, chat(text), **fresh)
        assert r.status_code == 200, r.text
        expected[text] = r.json()["choices"][0]["message"]["content"]
    outcomes: list[tuple[float, float, int, bool]] = []
    stop = asyncio.Event()

    async def worker(k: int) -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as own:
            i = k
            while not stop.is_set():
                text = prompts[i % len(prompts)]
                began = time.monotonic()
                try:
                    r = await ask(own, cluster.lb_url, chat(text), **fresh)
                    status = r.status_code
                    right = status != 200 or (
                        r.json()["choices"][0]["message"]["content"] == expected[text]
                    )
                except httpx.HTTPError:
                    status, right = 0, True
                outcomes.append((began, time.monotonic(), status, right))
                i += 1

    workers = [asyncio.create_task(worker(k)) for k in range(3)]
    try:
        await asyncio.sleep(2.0)
        killed_at = time.monotonic()
        await asyncio.to_thread(cluster.kill, "d1")
        killed_done = time.monotonic()
        while len([o for o in outcomes if o[0] > killed_done]) < 15:
            assert time.monotonic() - killed_done < 90, "the load stalled after the kill"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    failed = [o for o in outcomes if o[2] != 200]
    print(f"{len(outcomes)} requests, {len(failed)} failed (in flight on d1 at the kill)")
    assert all(right for *_, right in outcomes), "an answer that is not the greedy one"
    assert all(o[0] <= killed_done and o[1] >= killed_at for o in failed), failed
    assert len(failed) <= len(workers)
    assert len([o for o in outcomes if o[0] > killed_done and o[2] == 200]) >= 15  # by d2
    # as it was: d1 back, d2 out of the pools (on both gateways, through the store) and down
    await asyncio.to_thread(cluster.start, "d1")
    for gw in (gw1, gw2):
        # until d1 serves there again
        await wait_until_async(
            lambda gw=gw: _both(client, gw, {d1, d2}), timeout_s=30.0, interval_s=0.1
        )
    gone = await client.delete(f"{gw1}{DECODE_SERVERS}", params={"url": d2}, headers=AUTH)
    assert gone.status_code == 200, gone.text
    for gw in (gw1, gw2):
        # until d2 has left there
        await wait_until_async(
            lambda gw=gw: _both(client, gw, {d1}), timeout_s=10.0, interval_s=0.1
        )
    await asyncio.to_thread(cluster.stop, "d2")


async def _both(client: httpx.AsyncClient, base: str, urls: set[str]) -> bool:
    return await decode_serving(client, base) == urls


async def test_the_decode_host_stops_503_with_retry_after_never_a_hang(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    # The host vanishes (link down): connections to it time out instead of being refused.
    await asyncio.to_thread(cluster.unplug, "d1")
    for base in (cluster.gateway_url("gw1"), cluster.gateway_url("gw2"), cluster.lb_url):
        began = time.monotonic()
        statuses = []
        for _ in range(3):  # the first may still find the server marked healthy
            r = await ask(client, base, chat(unique()))
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "backend_unavailable"
                break
        assert statuses[-1] == 503, (base, statuses)
        assert time.monotonic() - began < 30, base
