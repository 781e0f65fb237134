"""Two gateways sharing one real redis-server: one's writes become the other's hits."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as redis_asyncio

from semcache.semantic.cache import SemanticCache
from semcache.semantic.encoder import Encoder
from semcache.semantic.feed import RedisEntryFeed
from semcache.semantic.index import SemanticIndex
from semcache.semantic.match import Match
from semcache.semantic.partition_types import IndexSettings
from semcache.semantic.records import PartitionKey
from semcache.semantic.verified.decisions import Observation
from semcache.semantic_settings import SemanticRule
from tests.semcache.conftest import RedisServer
from tests.support.waiting import wait_until_async

RULE = SemanticRule(enabled=True, threshold=0.85)


def gateway(encoder: Encoder, client: redis_asyncio.Redis, stream: str) -> SemanticCache:
    index = SemanticIndex(IndexSettings(dimensions=encoder.dimensions, background=False))
    return SemanticCache(encoder, index, feed=RedisEntryFeed(client, stream=stream))


async def wait_for_hit(
    cache: SemanticCache, key: PartitionKey, text: str, deadline_s: float
) -> Match | None:
    """Poll until the entry arrives (the feed's reader adds it in the background)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        (match,) = await cache.lookup(key, [text], RULE)
        if match is not None:
            return match
        await asyncio.sleep(0.05)
    return None


@pytest.mark.slow
async def test_an_entry_written_by_one_gateway_is_found_by_another(
    encoder: Encoder, redis_server: RedisServer
) -> None:
    client = redis_asyncio.Redis.from_url(redis_server.url)
    stream = f"semantic-test-{time.time_ns()}"
    first, second = gateway(encoder, client, stream), gateway(encoder, client, stream)
    await first.start()
    await second.start()
    try:
        key = first.partition_key(scope="t", model_revision="r", task="embeddings", template="x")
        assert key == second.partition_key(
            scope="t", model_revision="r", task="embeddings", template="x"
        )
        other = first.partition_key(scope="u", model_revision="r", task="embeddings", template="x")
        await first.insert(key, ["How do I reset my password?"], ["ref-1"], 60, rule=RULE)
        match = await wait_for_hit(second, key, "How can I reset my password?", deadline_s=5.0)
        assert match is not None and match.payload_ref == "ref-1"
        # The feed keeps partitions: another tenant still has nothing.
        assert await second.lookup(other, ["How can I reset my password?"], RULE) == [None]
        # A gateway does not re-add its own records from the stream.
        assert isinstance(first.feed, RedisEntryFeed) and first.feed.delivered == 0
    finally:
        await first.aclose()
        await second.aclose()
        await client.aclose()


@pytest.mark.slow
async def test_a_new_gateway_can_replay_the_stream(
    encoder: Encoder, redis_server: RedisServer
) -> None:
    client = redis_asyncio.Redis.from_url(redis_server.url)
    stream = f"semantic-replay-{time.time_ns()}"
    writer = gateway(encoder, client, stream)
    key = writer.partition_key(scope="t", model_revision="r", task="embeddings", template="x")
    await writer.insert(key, ["What is the capital of France?"], ["ref-paris"], 60, rule=RULE)
    index = SemanticIndex(IndexSettings(dimensions=encoder.dimensions, background=False))
    late = SemanticCache(encoder, index, feed=RedisEntryFeed(client, stream=stream, replay=True))
    await late.start()
    try:
        match = await wait_for_hit(late, key, "what is the capital of france", deadline_s=5.0)
        assert match is not None and match.payload_ref == "ref-paris"
    finally:
        await late.aclose()
        await writer.aclose()
        await client.aclose()


@pytest.mark.slow
async def test_a_restarted_gateway_resumes_after_its_saved_cursor(
    encoder: Encoder, redis_server: RedisServer
) -> None:
    """Entries written while a gateway was down arrive; those it had applied do not again."""
    client = redis_asyncio.Redis.from_url(redis_server.url)
    stream = f"semantic-resume-{time.time_ns()}"
    writer = gateway(encoder, client, stream)
    key = writer.partition_key(scope="t", model_revision="r", task="embeddings", template="x")
    await writer.insert(key, ["What is the capital of France?"], ["ref-seen"], 60, rule=RULE)
    cursor = (await client.xrevrange(stream, count=1))[0][0].decode()  # what it had applied
    await writer.insert(key, ["How do I reset my password?"], ["ref-missed"], 60, rule=RULE)
    index = SemanticIndex(IndexSettings(dimensions=encoder.dimensions, background=False))
    feed = RedisEntryFeed(client, stream=stream, replay=True, start_id=cursor)
    restarted = SemanticCache(encoder, index, feed=feed)
    await restarted.start()
    try:
        match = await wait_for_hit(restarted, key, "How can I reset my password?", deadline_s=5.0)
        assert match is not None and match.payload_ref == "ref-missed"
        assert feed.delivered == 1  # not the record before the cursor
        assert feed.last_id is not None
        assert tuple(map(int, feed.last_id.split("-"))) > tuple(map(int, cursor.split("-")))
    finally:
        await restarted.aclose()
        await client.aclose()


@pytest.mark.slow
async def test_observations_reach_the_other_gateway_and_merge(
    encoder: Encoder, redis_server: RedisServer
) -> None:
    """A judged observation travels with its entry's record; each side keeps both its own
    and the other's."""
    client = redis_asyncio.Redis.from_url(redis_server.url)
    stream = f"semantic-observations-{time.time_ns()}"
    first, second = gateway(encoder, client, stream), gateway(encoder, client, stream)
    await first.start()
    await second.start()
    try:
        key = first.partition_key(scope="t", model_revision="r", task="chat", template="x")
        await first.insert(key, ["What is the capital of France?"], ["ref-1"], 60, rule=RULE)
        assert await wait_for_hit(second, key, "what is the capital of france", 5.0) is not None
        mine = Observation(similarity=0.93, correct=True, at=1.0)
        theirs = Observation(similarity=0.88, correct=False, at=2.0)
        assert await first.observe(key, "ref-1", mine)
        assert await second.observe(key, "ref-1", theirs)

        def both(cache: SemanticCache) -> bool:
            part = cache.index.get(key)
            return part is not None and part.observations_of("ref-1") == [mine, theirs]

        await wait_until_async(lambda: both(first) and both(second), timeout_s=5.0)
        part = second.index.get(key)
        assert part is not None and part.prior.count == 2
    finally:
        await first.aclose()
        await second.aclose()
        await client.aclose()
