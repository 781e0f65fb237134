"""Selective disaggregation without vLLM: with the prompt's blocks known, the prefill hop runs
only when the decode server chosen lacks ``prefill_threshold_tokens`` of it, and the prefill
server is chosen by its own cached prefix. The servers are the fake upstreams of
``test_pd_flow``; the index is filled by hand (real vLLM's events: ``test_pd_gateway.py``)."""

from __future__ import annotations

from typing import Any

from backends.config import VllmBackendConfig, VllmServer
from backends.fleet.salt import CacheSalter
from backends.kv_settings import KvSettings
from backends.vllm.client import VllmClient
from tests.backends.test_pd_flow import (
    CHAT,
    DECODE_1,
    PREFILL,
    Make,
    Upstream,
    chat,
    ctx,
    decode_ok,
    prefill_ok,
    upstream,
)

__all__ = ["upstream"]  # the fixture, shared

PREFILL_2 = "prefill-2"
SALT = CacheSalter(b"k").salt("key:a")


class WordTokenizer:
    """One token per word: the prompt's ids without a model."""

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        words = " ".join(m["content"] for m in body["messages"]).split()
        return [hash(w) % 1000 for w in words]


def kv_client(up: Upstream, prefill: tuple[str, ...] = (PREFILL,)) -> VllmClient:
    servers = [
        VllmServer(url=up.url(name), role="prefill", kv_events="tcp://127.0.0.1:1")
        for name in prefill
    ]
    servers.append(VllmServer(url=up.url(DECODE_1), role="decode", kv_events="tcp://127.0.0.1:1"))
    config = VllmBackendConfig(
        name="t",
        served_model="m",
        servers=servers,
        placement="kv",
        kv=KvSettings(block_size=32),
        prefill_threshold_tokens=64,
        health_interval_s=3600,
    )
    client = VllmClient(config, CacheSalter(b"k"))
    assert client.kv is not None
    client.kv.tokenizer = WordTokenizer()  # type: ignore[assignment]
    return client


def hold(client: VllmClient, url: str, text: str, tokens: int | None = None) -> None:
    """``url`` holds the blocks of ``text``'s prompt (its first ``tokens``)."""
    assert client.kv is not None
    ids = WordTokenizer().prompt_tokens(CHAT, chat(text))[:tokens]
    client.kv.index.store(url.rstrip("/"), client.kv.hasher.event_hashes(ids, 32, SALT))


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def test_a_decode_server_holding_the_history_computes_the_new_turn_alone(
    upstream: Make,
) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = kv_client(up)
    history = words(320)
    hold(c, up.url(DECODE_1), history + " " + words(40, "q"), tokens=320)
    stream = await c.open_stream(CHAT, chat(history + " " + words(40, "q"), stream=True), ctx())
    decode = next(s for s in c.decode_pool.servers)
    assert decode.pending_tokens == 0  # settled at the first event, though the stream is open
    assert b"[DONE]" in await stream.read_all()
    assert up.bodies(PREFILL) == []
    assert "kv_transfer_params" not in up.bodies(DECODE_1)[0]
    assert c.stats.prefill_skipped == {"cached_on_decode": 1}
    assert decode.pending_tokens == 0 and decode.inflight == 0
    await c.aclose()


async def test_uncached_tokens_past_the_threshold_take_the_prefill_hop(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = kv_client(up)
    prompt = words(320)
    hold(c, up.url(DECODE_1), prompt, tokens=160)  # half of it: 160 tokens to compute
    assert (await c.post(CHAT, chat(prompt), ctx())).status == 200
    assert len(up.bodies(PREFILL)) == 1
    assert up.bodies(DECODE_1)[0]["kv_transfer_params"]
    assert c.stats.prefill_skipped == {}
    await c.aclose()


async def test_the_threshold_counts_exact_tokens_not_the_estimate(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = kv_client(up)
    # 40 words estimate past 64 tokens at 4 characters a token, but are 40 tokens
    long_words = " ".join(f"extraordinarily{i}" for i in range(40))
    assert (await c.post(CHAT, chat(long_words), ctx())).status == 200
    assert up.bodies(PREFILL) == []
    assert c.stats.prefill_skipped == {"short_prompt": 1}
    await c.aclose()


async def test_a_prompt_shorter_than_one_block_is_computed_by_decode_alone(
    upstream: Make,
) -> None:
    """No whole block to look up is still a known length: under the threshold."""
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = kv_client(up)
    assert (await c.post(CHAT, chat(words(10)), ctx())).status == 200
    assert up.bodies(PREFILL) == []
    assert c.stats.prefill_skipped == {"short_prompt": 1}
    await c.aclose()


async def test_the_prefill_server_is_the_one_holding_the_prompt(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, PREFILL_2: prefill_ok, DECODE_1: decode_ok})
    for first in (PREFILL, PREFILL_2):
        c = kv_client(up, prefill=(PREFILL, PREFILL_2))
        prompt = words(320, first)
        hold(c, up.url(first), prompt, tokens=256)
        before = len(up.bodies(first))
        assert (await c.post(CHAT, chat(prompt), ctx())).status == 200
        assert len(up.bodies(first)) == before + 1
        assert c.prefill_pool is not None
        assert all(s.pending_tokens == 0 for s in c.prefill_pool.servers)
        await c.aclose()


async def test_without_the_prompts_blocks_the_estimate_decides(upstream: Make) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = kv_client(up)
    assert c.kv is not None
    c.kv.tokenizer = None  # still loading: no exact blocks
    assert (await c.post(CHAT, chat(words(320)), ctx())).status == 200
    assert (await c.post(CHAT, chat("Hello there"), ctx())).status == 200
    assert len(up.bodies(PREFILL)) == 1
    assert c.stats.prefill_skipped == {"short_prompt": 1}
    await c.aclose()


async def test_a_session_pins_the_servers_and_its_blocks_still_decide_the_hop(
    upstream: Make,
) -> None:
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = kv_client(up)
    history = words(320)
    hold(c, up.url(DECODE_1), history, tokens=320)
    prompt = chat(history + " " + words(20, "q"))
    assert (await c.post(CHAT, prompt, ctx(session_affinity="conversation-1"))).status == 200
    assert up.bodies(PREFILL) == []
    assert c.stats.prefill_skipped == {"cached_on_decode": 1}
    await c.aclose()


async def test_each_request_counts_one_decision_per_pool(upstream: Make) -> None:
    # The prefill step asks whether a prefill server is up without ranking (a ranking counts
    # a decision): one decision per pool a request is placed in.
    up = await upstream({PREFILL: prefill_ok, DECODE_1: decode_ok})
    c = kv_client(up)
    assert c.kv is not None
    prompt = words(320)
    hold(c, up.url(PREFILL), prompt, tokens=256)
    for _ in range(3):
        assert (await c.post(CHAT, chat(prompt), ctx())).status == 200
    reasons = c.kv.scorer.decisions.reasons
    assert sum(n for (role, _), n in reasons.items() if role == "prefill") == 3
    assert sum(n for (role, _), n in reasons.items() if role == "decode") == 3
    await c.aclose()
