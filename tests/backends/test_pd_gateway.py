"""Disaggregated prefill/decode through the real gateway, against real vLLM servers (CPU).

One prefill and two decode servers (NixlConnector) are started once for the module, plus the
session's monolithic server for comparisons. The tests run in file order; the failover test
kills servers and comes last.

The decode servers get a small KV cache (48 blocks of 32 tokens): the affinity test needs the
8 conversations' KV (about 10 blocks each, 2 of them the shared system prompt) not to fit on
one decode server while half of them fit on each.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.placement import rendezvous_order
from backends.fleet.server_state import ServerState
from backends.kv_settings import KvSettings
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import metric_value, parse_metric
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm
from server.config import GatewayConfig, ModelEntry
from tests.support.waiting import wait_until, wait_until_async

# Starting three vLLM servers counts towards the first test's time limit.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

DECODE_KV_BLOCKS = 48
KV_BYTES_PER_TOKEN = 1024  # tiny Llama: 2 layers x 2 KV heads x 64 dims x (K, V) x bf16
BLOCK = 32
REQUEST_TIMEOUT_S = 300.0  # bounded (no hang), but a 2-core CI box under this suite is slow

SYSTEM = (
    "You are the helpful assistant of the city library. Answer the question of the reader "
    "briefly and politely."
)
SENTENCES = [
    "The cat reads a book near the window.",
    "A bird visits the old tree every day.",
    "Our team builds a small house before the rain.",
    "The teacher answers the question in the morning.",
    "My friend paints the blue sea after lunch.",
    "They follow the road to the capital of France.",
    "She carries a letter to the garden with care.",
    "We find the map in Paris again.",
]


def story(tag: str, sentences: int) -> str:
    """English-like text the tiny tokenizer knows (about 10 tokens a sentence), unique by tag."""
    words = [f"Story {tag}."]
    words += [SENTENCES[(i * 5 + len(tag)) % len(SENTENCES)] for i in range(sentences)]
    return " ".join(words)


@pytest.fixture(scope="module")
def kv_events() -> dict[str, tuple[str, str]]:
    """Each server's KV events and replay sockets (KV placement reads them)."""
    names = ("prefill", "decode1", "decode2")
    return {n: (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for n in names}


@pytest.fixture(scope="module")
async def pd_servers(
    data_dir: Path, kv_events: dict[str, tuple[str, str]]
) -> AsyncIterator[dict[str, VllmProcess]]:
    """prefill (core 0), decode-1 (core 1), decode-2 (core 0), started together, each
    publishing its KV events."""
    kv_gib = DECODE_KV_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN / (1 << 30)
    specs = {
        "prefill": ("prefill", "0", 0.25),
        "decode1": ("decode", "1", kv_gib),
        "decode2": ("decode", "0", kv_gib),
    }
    tasks = {
        name: asyncio.create_task(
            start_tiny_vllm(
                data_dir,
                free_port(),
                role,  # type: ignore[arg-type]
                core,
                kv_cache_gib=kv,
                max_model_len=1024,  # within the decode servers' 48 blocks
                nixl_side_channel_port=free_port(),
                block_size=BLOCK,
                extra_args=[
                    part
                    for pair in KvSettings().launch_flags(*kv_events[name])
                    for part in pair
                    if part
                ],
                progress=None,
            )
        )
        for name, (role, core, kv) in specs.items()
    }
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    started = {n: t.result() for n, t in tasks.items() if t.exception() is None}
    try:
        failed = [t.exception() for t in tasks.values() if t.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        yield started
    finally:
        await asyncio.gather(*(p.stop() for p in started.values()))


def pd_config(
    data_dir: Path, urls: dict[str, list[str]], *, policy: Path | None = None, **backend: Any
) -> GatewayConfig:
    """A gateway with the tiny model on the given prefill/decode (or monolithic) servers."""
    settings: dict[str, Any] = {
        "prefill_threshold_tokens": 32,
        "health_interval_s": 1.0,
        # vLLM's NIXL pull on this CPU sometimes stalls until the prefill's 30 s KV lease
        # expires ("Releasing expired KV blocks" in its log); two in a row passed 60 s.
        "read_timeout_s": 150.0,
        "cache_salt_secret": "test-secret",
        **backend,
    }
    servers = [VllmServer(url=u, role=role) for role, us in urls.items() for u in us]  # type: ignore[arg-type]
    return GatewayConfig(
        data_dir=str(data_dir),
        cache=False,  # every request reaches vLLM
        policy=str(policy) if policy else None,
        models=[
            ModelEntry(id="tiny-chat", backend="tiny"),
            ModelEntry(id="tiny-shared", backend="tiny"),
        ],
        backends=[
            VllmBackendConfig(
                name="tiny",
                served_model=TINY_MODEL_NAME,
                revision="test",
                servers=servers,
                **settings,
            )
        ],
    )


@pytest.fixture(scope="module")
def pd_gateway(
    pd_servers: dict[str, VllmProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """1P1D: the prefill server and decode-1, warmed by one hand-off.

    The first NIXL transfer between two servers also makes their handshake; on a loaded CI
    box it has timed out and the decode server recomputed the prompt, so the tests measure
    from the second one on.
    """
    urls = {"prefill": [pd_servers["prefill"].url], "decode": [pd_servers["decode1"].url]}
    tmp = tmp_path_factory.mktemp("pd")
    gw = GatewayProcess(write_config_toml(pd_config(tmp / "data", urls), tmp / "gateway.toml"))
    warm = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": story("warm-up", 10)}],
        "max_tokens": 1,
    }

    # A warm-up hand-off that failed ejects the decode server until a health check passes;
    # /ready checks every server now (re-admitting one that answers), so wait for it.
    def pd_gateway_ready() -> bool:
        return httpx.get(f"{gw.url}/ready", timeout=30).status_code == 200

    try:
        gw.start()
        httpx.post(f"{gw.url}/v1/chat/completions", json=warm, timeout=REQUEST_TIMEOUT_S)
        wait_until(pd_gateway_ready, timeout_s=60, interval_s=0.5)
        yield gw
    finally:
        gw.stop()


async def settled(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """A counter's value once it stops moving (vLLM updates them just after answering).

    vLLM signals no "counters updated" event: only a counter that stays put shows it."""
    last = await metric_value(url, name, labels)
    for _ in range(40):
        await asyncio.sleep(0.25)
        now = await metric_value(url, name, labels)
        if now == last:
            return now
        last = now
    return last


async def post(
    client: httpx.AsyncClient, base: str, path: str, body: dict[str, Any], **headers: str
) -> httpx.Response:
    return await asyncio.wait_for(
        client.post(f"{base}{path}", json=body, headers=headers), REQUEST_TIMEOUT_S
    )


def sse_text(raw: bytes) -> tuple[str, dict[str, Any] | None, bool]:
    """(text, usage, saw [DONE]) of an SSE answer (chat deltas or completion texts)."""
    text, usage, done = [], None, False
    for line in raw.decode().splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        event = orjson.loads(data)
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(text), usage, done


def answer_text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


# -- 1P1D: the KV really moves, and the answer is a monolithic server's ---------------------


async def test_decode_pulls_the_whole_prompt_over_nixl(
    pd_servers: dict[str, VllmProcess], pd_gateway: GatewayProcess
) -> None:
    decode = pd_servers["decode1"].url
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": story(uuid.uuid4().hex, 50)}],
        "max_tokens": 8,
        "temperature": 0,
    }
    external = await settled(decode, "vllm:external_prefix_cache_hits_total")
    local = await settled(decode, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        r = await post(client, pd_gateway.url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 400
    external_after = await settled(decode, "vllm:external_prefix_cache_hits_total")
    local_after = await settled(
        decode, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}
    )
    assert external_after - external == prompt_tokens
    assert local_after == local


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_responses_request_pulls_its_prompt_over_nixl(
    pd_servers: dict[str, VllmProcess], pd_gateway: GatewayProcess, stream: bool
) -> None:
    decode = pd_servers["decode1"].url
    tag = uuid.uuid4().hex
    body = {
        "model": "tiny-chat",
        "instructions": f"Story {tag}. {SYSTEM}",  # no block of it cached on decode already
        "input": story(tag, 50),
        "max_output_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    external = await settled(decode, "vllm:external_prefix_cache_hits_total")
    local = await settled(decode, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        r = await post(client, pd_gateway.url, "/v1/responses", body)
    assert r.status_code == 200, r.text
    if stream:
        last = r.content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert last.startswith(b"event: response.completed\ndata: ")
        answer = orjson.loads(last.split(b"data: ", 1)[1])["response"]
    else:
        answer = r.json()
    assert answer["output"][0]["content"][0]["text"]
    prompt_tokens = answer["usage"]["input_tokens"]
    assert prompt_tokens > 400
    external_after = await settled(decode, "vllm:external_prefix_cache_hits_total")
    local_after = await settled(
        decode, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}
    )
    assert external_after - external == prompt_tokens
    assert local_after == local


async def test_short_prompts_skip_prefill(
    pd_servers: dict[str, VllmProcess], pd_gateway: GatewayProcess
) -> None:
    prefill, decode = pd_servers["prefill"].url, pd_servers["decode1"].url
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": f"Hi {uuid.uuid4().hex[:6]}"}],
        "max_tokens": 4,
    }
    prefill_tokens = await settled(prefill, "vllm:prompt_tokens_total")
    local = await settled(decode, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        r = await post(client, pd_gateway.url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert await settled(prefill, "vllm:prompt_tokens_total") == prefill_tokens
    local_after = await settled(
        decode, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}
    )
    assert local_after - local == prompt_tokens


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_greedy_output_equals_a_monolithic_server(
    route: str, tiny_vllm: VllmProcess, pd_gateway: GatewayProcess
) -> None:
    """Same text and usage as one server, stream and not, for several prompts.

    The random-weight model can have near-ties between tokens; the notes of the run say how
    many prompts matched (all must).
    """
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    mismatches = []
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for i in range(4):
            text = story(f"{uuid.uuid4().hex[:8]}-{i}", 30 + 7 * i)
            prompt: dict[str, Any] = (
                {"messages": [{"role": "user", "content": text}]}
                if route == "chat"
                else {"prompt": text}
            )
            body = {"model": "tiny-chat", **prompt, "max_tokens": 24, "temperature": 0}
            mono = await post(client, tiny_vllm.url, path, {**body, "model": TINY_MODEL_NAME})
            pd = await post(client, pd_gateway.url, path, body)
            assert mono.status_code == pd.status_code == 200, pd.text
            mono_body, pd_body = mono.json(), pd.json()
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert pd_body["usage"][key] == mono_body["usage"][key]
            streamed = await post(
                client,
                pd_gateway.url,
                path,
                {**body, "stream": True, "stream_options": {"include_usage": True}},
            )
            assert streamed.status_code == 200
            assert streamed.headers["content-type"].startswith("text/event-stream")
            stream_text, usage, done = sse_text(streamed.content)
            assert done and usage is not None
            assert usage["prompt_tokens"] == mono_body["usage"]["prompt_tokens"]
            expected = answer_text(mono_body)
            if answer_text(pd_body) != expected or stream_text != expected:
                mismatches.append((i, expected, answer_text(pd_body), stream_text))
    assert mismatches == []


async def test_gateway_metrics_count_hops_and_copy_the_servers_counters(
    pd_servers: dict[str, VllmProcess], pd_gateway: GatewayProcess
) -> None:
    """What the gateway's ``/metrics`` says about its vLLM servers, after the traffic above."""
    decode = {"backend": "tiny", "server": pd_servers["decode1"].url, "role": "decode"}
    copied_name = "semcache_upstream_vllm_external_prefix_cache_hits_total"
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(100):  # a health round (every second here) scrapes the servers' counters
            page = (await client.get(f"{pd_gateway.url}/metrics")).text
            if parse_metric(page, copied_name, decode) > 0:
                break
            await asyncio.sleep(0.1)
    assert parse_metric(page, "semcache_pd_hops_total", {"hop": "prefill"}) >= 9
    assert parse_metric(page, "semcache_pd_prefill_skipped_total", {"reason": "short_prompt"}) >= 1
    assert parse_metric(page, "semcache_pd_kv_handoff_seconds_count") >= 8  # the streams
    prefills = parse_metric(page, "semcache_pd_prefill_seconds_count")
    assert prefills >= 9 and parse_metric(page, "semcache_pd_prefill_seconds_sum") > 0
    assert parse_metric(page, "semcache_backend_server_healthy", decode) == 1
    assert parse_metric(page, "semcache_backend_server_inflight", decode) == 0
    copied = parse_metric(page, copied_name, decode)
    assert copied > 0
    assert copied <= await metric_value(decode["server"], "vllm:external_prefix_cache_hits_total")


# -- selective disaggregation: the decode server's cached history decides ---------------------


async def test_a_turn_whose_history_the_decode_server_holds_skips_the_prefill_hop(
    data_dir: Path,
    pd_servers: dict[str, VllmProcess],
    kv_events: dict[str, tuple[str, str]],
    tmp_path: Path,
) -> None:
    """KV placement, fed by the real servers' events: the first turn's prompt is missing on
    the decode server, so it is prefilled and pulled; the next turn lacks only its new
    tokens there (under the threshold), so decode computes them itself from its cache."""
    prefill_events, decode_events = kv_events["prefill"], kv_events["decode1"]
    urls = {"prefill": [pd_servers["prefill"].url], "decode": [pd_servers["decode1"].url]}
    config = pd_config(tmp_path / "data", urls, prefill_threshold_tokens=64)
    (backend,) = config.backends
    assert isinstance(backend, VllmBackendConfig)
    for server, (events, replay) in zip(
        backend.servers, (prefill_events, decode_events), strict=True
    ):
        server.kv_events, server.kv_events_replay = events, replay
    backend.placement = "kv"
    backend.model_path = str(data_dir / "models" / TINY_MODEL_NAME)  # its tokenizer
    backend.kv = KvSettings(block_size=BLOCK)
    gw = GatewayProcess(write_config_toml(config, tmp_path / "gateway.toml"))
    decode = pd_servers["decode1"].url
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": story(uuid.uuid4().hex, 30)},
    ]
    try:
        gw.start()
        gw.wait_answers("/ready", 120)  # a busy gateway may take seconds to answer a probe
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            batches = {"server": decode, "kind": "batches"}
            page = (await client.get(f"{gw.url}/metrics")).text
            seen = parse_metric(page, "semcache_kv_events_total", batches)
            body = {"model": "tiny-chat", "messages": history, "max_tokens": 4}
            first = await post(client, gw.url, "/v1/chat/completions", body)
            assert first.status_code == 200, first.text
            prompt = first.json()["usage"]["prompt_tokens"]

            async def decode_stored_it() -> bool:  # its BlockStored for the pulled blocks
                page = (await client.get(f"{gw.url}/metrics")).text
                return parse_metric(page, "semcache_kv_events_total", batches) > seen

            await wait_until_async(decode_stored_it, timeout_s=20)
            page = (await client.get(f"{gw.url}/metrics")).text
            assert parse_metric(page, "semcache_pd_hops_total", {"hop": "prefill"}) == 1
            hits = await settled(decode, "vllm:prefix_cache_hits_total")
            turn = [*history, {"role": "assistant", "content": "Yes."}]
            turn.append({"role": "user", "content": "And then?"})
            second = await post(client, gw.url, "/v1/chat/completions", {**body, "messages": turn})
            assert second.status_code == 200, second.text
            page = (await client.get(f"{gw.url}/metrics")).text
        skipped = "semcache_pd_prefill_skipped_total"
        assert parse_metric(page, skipped, {"reason": "cached_on_decode"}) == 1
        assert parse_metric(page, "semcache_pd_hops_total", {"hop": "prefill"}) == 1
        reasons = {"role": "decode", "reason": "cache"}
        assert parse_metric(page, "semcache_kv_placement_decisions_total", reasons) >= 1
        held = await settled(decode, "vllm:prefix_cache_hits_total") - hits
        assert held >= (prompt // BLOCK) * BLOCK  # vLLM agrees: the history was there
    finally:
        gw.stop()


# -- tenant isolation inside vLLM ------------------------------------------------------------


async def test_cache_salt_isolates_tenants_and_shares_a_shared_scope(
    tiny_vllm: VllmProcess, tmp_path: Path, start_gateway: Callable[[GatewayConfig], GatewayProcess]
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[models."tiny-shared".routes.chat]\nshared = true\n')
    gw = start_gateway(pd_config(tmp_path / "gw", {"both": [tiny_vllm.url]}, policy=policy))

    async def cached(client: httpx.AsyncClient, model: str, key: str, text: str) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        r = await post(client, gw.url, "/v1/chat/completions", body, authorization=f"Bearer {key}")
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        private = story(uuid.uuid4().hex, 20)
        assert await cached(client, "tiny-chat", "key-a", private) == 0
        assert await cached(client, "tiny-chat", "key-a", private) >= 4 * BLOCK
        assert await cached(client, "tiny-chat", "key-b", private) == 0
        shared = story(uuid.uuid4().hex, 20)
        assert await cached(client, "tiny-shared", "key-a", shared) == 0
        assert await cached(client, "tiny-shared", "key-b", shared) >= 4 * BLOCK


# -- backpressure ------------------------------------------------------------------------------


async def test_a_full_pool_answers_429_with_retry_after(
    tiny_vllm: VllmProcess, tmp_path: Path, start_gateway: Callable[[GatewayConfig], GatewayProcess]
) -> None:
    config = pd_config(
        tmp_path / "data",
        {"both": [tiny_vllm.url]},
        max_inflight_per_server=1,
        max_queue=1,
        retry_after_s=3,
    )
    gw = start_gateway(config)
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Write a long story."}],
        # ~1.5 s: long enough that the first answer is still running when all six arrive
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        answers = await asyncio.gather(
            *(post(client, gw.url, "/v1/chat/completions", body) for _ in range(6))
        )
    statuses = sorted(r.status_code for r in answers)
    assert statuses.count(200) == 2  # one ran, one waited in the queue
    assert statuses.count(429) == 4
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "backend_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]


# -- affinity over two decode servers ------------------------------------------------------------


def split_sessions(decode_urls: list[str], per_server: int) -> list[str]:
    """Session ids that rendezvous hashing spreads evenly, ``per_server`` on each server.

    The KV sizing of the decode servers assumes an even split; the routing itself is what
    the test checks.
    """
    states = [ServerState(VllmServer(url=u, role="decode"), limit=1) for u in decode_urls]
    chosen: dict[str, list[str]] = {u: [] for u in decode_urls}
    while any(len(v) < per_server for v in chosen.values()):
        session = f"conv-{uuid.uuid4().hex[:12]}"
        owner = rendezvous_order(session, states)[0].url
        if len(chosen[owner]) < per_server:
            chosen[owner].append(session)
    return [s for pair in zip(*chosen.values(), strict=True) for s in pair]


async def decode_hit_rate(urls: list[str], run: Any) -> float:
    """Local prefix-cache hits / queries over the decode servers while ``run()`` runs."""

    async def totals() -> tuple[float, float]:
        hits = queries = 0.0
        for url in urls:
            hits += await settled(url, "vllm:prefix_cache_hits_total")
            queries += await settled(url, "vllm:prefix_cache_queries_total")
        return hits, queries

    hits, queries = await totals()
    await run()
    hits_after, queries_after = await totals()
    return (hits_after - hits) / max(1.0, queries_after - queries)


async def test_session_affinity_doubles_the_decode_prefix_hit_rate(
    pd_servers: dict[str, VllmProcess],
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    decode_urls = [pd_servers["decode1"].url, pd_servers["decode2"].url]
    urls = {"prefill": [pd_servers["prefill"].url], "decode": decode_urls}
    # the shared system prompt fills the prefix window: without the header, every
    # conversation prefers the same decode server (prefix-aware placement). The prompts skip
    # the prefill hop (threshold above their length): a NIXL hand-off costs seconds on these
    # CPUs, and what is measured is the decode servers' own prefix cache either way.
    config = pd_config(tmp_path / "data", urls, prefix_tokens=16, prefill_threshold_tokens=100_000)
    gw = start_gateway(config)
    sessions = split_sessions(decode_urls, per_server=4)

    async def conversations(tag: str, affinity: bool) -> None:
        history: dict[str, list[dict[str, str]]] = {
            s: [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": story(f"{tag}-{s}", 18)},
            ]
            for s in sessions
        }
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            for turn in range(2):
                for session in sessions:
                    headers = {"x-session-affinity": session} if affinity else {}
                    body = {
                        "model": "tiny-chat",
                        "messages": history[session],
                        "max_tokens": 8,
                        "temperature": 0,
                    }
                    r = await post(client, gw.url, "/v1/chat/completions", body, **headers)
                    assert r.status_code == 200, r.text
                    if turn == 0:
                        history[session] += [
                            {"role": "assistant", "content": answer_text(r.json())},
                            {"role": "user", "content": "Tell me more about the garden."},
                        ]

    without = await decode_hit_rate(
        decode_urls, lambda: conversations(uuid.uuid4().hex[:6], affinity=False)
    )
    with_header = await decode_hit_rate(
        decode_urls, lambda: conversations(uuid.uuid4().hex[:6], affinity=True)
    )
    print(f"decode prefix-cache hit rate: without header {without:.3f}, with {with_header:.3f}")
    assert with_header >= 2 * without
    assert with_header > 0.3


# -- failover (kills servers: keep it last) ------------------------------------------------------


async def test_failover_prefill_then_decode_then_all(
    pd_servers: dict[str, VllmProcess],
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    decode_urls = [pd_servers["decode1"].url, pd_servers["decode2"].url]
    urls = {"prefill": [pd_servers["prefill"].url], "decode": decode_urls}
    gw = start_gateway(pd_config(tmp_path / "data", urls))
    done: list[tuple[int, str]] = []  # (index, outcome)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        stream = i % 3 == 0
        body: dict[str, Any] = {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": story(f"{uuid.uuid4().hex}-{i}", 25)}],
            "max_tokens": 48,
            "ignore_eos": True,
            "stream": stream,
        }
        r = await post(client, gw.url, "/v1/chat/completions", body)
        if not stream:
            done.append((i, "ok" if r.status_code == 200 else f"status {r.status_code}"))
            return
        # a stream cut by a kill ends with an error event: clean, never a hang
        ended_cleanly = b"[DONE]" in r.content or b"backend_stream_broken" in r.content
        done.append((i, "ok" if b"[DONE]" in r.content else "broken" if ended_cleanly else "bad"))

    async def worker(client: httpx.AsyncClient, start: int, count: int) -> None:
        for i in range(start, start + count):
            await one(client, i)

    async def load(first: int, count: int) -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            await asyncio.gather(*(worker(client, first + k * count, count) for k in range(3)))

    async def under_way(phase: asyncio.Task[None]) -> None:
        """Until each worker has finished a request of ``phase`` (more are in flight)."""
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while len(done) < 3 and not phase.done():
            assert time.monotonic() < deadline, "the load made no progress"
            await asyncio.sleep(0.05)

    began = time.monotonic()
    phase = asyncio.create_task(load(0, 6))
    await under_way(phase)
    await asyncio.to_thread(pd_servers["prefill"].kill)
    await phase
    print(f"prefill killed: {Counter(o for _, o in done)}")
    assert [o for _, o in done].count("bad") == 0, done
    assert all(o == "ok" for i, o in done if i % 3), done  # non-stream: all succeeded

    done.clear()
    phase = asyncio.create_task(load(100, 6))
    await under_way(phase)
    await asyncio.to_thread(pd_servers["decode1"].kill)
    await phase
    print(f"decode-1 killed: {Counter(o for _, o in done)}")
    assert [o for _, o in done].count("bad") == 0, done
    assert all(o == "ok" for i, o in done if i % 3), done

    done.clear()
    await load(200, 2)  # after the dust settles: everything succeeds on decode-2
    assert [o for _, o in done] == ["ok"] * 6
    assert time.monotonic() - began < 600

    await asyncio.to_thread(pd_servers["decode2"].kill)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}]}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        statuses = []
        for _ in range(3):
            r = await post(client, gw.url, "/v1/chat/completions", body)
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "backend_unavailable"
                break
    assert statuses[-1] == 503, statuses
