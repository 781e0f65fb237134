"""The block index fed with the recorded events of a real vLLM: what it holds, gaps,
restarts, the cap."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from backends.fleet.kv.events import BlockRemoved, BlockStored, EventBatch
from backends.fleet.kv.feed import FeedStats, ServerFeed
from backends.fleet.kv.hashing import BlockHasher
from backends.fleet.kv.index import PoolBlockIndex
from tests.backends.kv import recorded

SERVER = "http://127.0.0.1:8001"


def feed(index: PoolBlockIndex | None = None, replay: str | None = None) -> ServerFeed:
    return ServerFeed(
        SERVER,
        "tcp://127.0.0.1:1",
        replay,
        "kv",
        index or PoolBlockIndex(1_000_000),
        BlockHasher(),
        FeedStats(),
    )


def chat_hashes() -> list[int]:
    event = recorded.batches()[0].events[0]
    assert isinstance(event, BlockStored)
    return [int(h) for h in event.block_hashes]


def held_by_events(batches: list[EventBatch]) -> set[int]:
    """The blocks a server holds after ``batches``, read straight off the events."""
    held: set[int] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                held |= {int(h) for h in event.block_hashes}
            elif isinstance(event, BlockRemoved):
                held -= {int(h) for h in event.block_hashes}
            else:
                held.clear()
    return held


def test_the_index_follows_the_server_through_eviction_and_reset() -> None:
    f = feed()
    batches = recorded.batches()
    for n, (seq, payload) in enumerate(recorded.messages(), start=1):
        f.accept(seq, payload)
        held = held_by_events(batches[:n])
        assert f.index.size(SERVER) == len(held)
        assert all(f.index.holds(SERVER, h) for h in held)
        assert f.index.size(SERVER) < recorded.KV_BLOCKS  # never more than the server's KV
    assert f.block_size == recorded.BLOCK_SIZE
    assert f.hash_matches is True
    assert f.stats.hash_checks["mismatch"] == 0
    assert f.stats.rebuilds[SERVER] == 1  # the AllBlocksCleared
    # after the reset the server holds the chat request's blocks again, and only them
    assert f.index.size(SERVER) == len(chat_hashes())
    assert f.index.matched_blocks(chat_hashes(), [SERVER]) == {SERVER: len(chat_hashes())}


def test_a_match_stops_at_the_first_block_a_server_lacks() -> None:
    index = PoolBlockIndex(100)
    hashes = chat_hashes()
    index.store("a", hashes[:10])
    index.store("b", hashes[:4])
    index.store("c", hashes[5:])  # not block 0: useless to vLLM, and matched as 0
    matched = index.matched_blocks(hashes, ["a", "b", "c", "d"])
    assert matched == {"a": 10, "b": 4, "c": 0, "d": 0}
    index.remove("a", [hashes[3]])
    assert index.matched_blocks(hashes, ["a"]) == {"a": 3}


def test_a_cleared_servers_place_in_the_index_goes_to_the_next_server_alone() -> None:
    index = PoolBlockIndex(100)
    hashes = chat_hashes()
    index.store("a", hashes[:6])
    index.store("b", hashes[:3])
    index.clear("a")
    index.store("c", hashes[:2])  # takes the place "a" held: none of "a"'s blocks with it
    assert index.matched_holders(hashes) == {"b": 3, "c": 2}
    index.store("a", hashes[:1])  # back, in a place of its own
    assert index.matched_holders(hashes) == {"a": 1, "b": 3, "c": 2}
    index.clear("b")
    index.clear("c")
    assert index.matched_holders(hashes) == {"a": 1}
    assert index.size() == 1
    index.remove("a", hashes[:1])
    assert index.matched_holders(hashes) == {} and index.size() == 0


def test_many_servers_holding_different_prefixes_each_get_their_own_depth() -> None:
    index = PoolBlockIndex(100)
    hashes = chat_hashes()
    depths = {f"s{i}": 1 + i % len(hashes) for i in range(130)}  # more servers than 2 words
    for server, depth in depths.items():
        index.store(server, hashes[:depth])
    assert index.matched_holders(hashes) == depths
    assert index.matched_holders(hashes[:1]) == dict.fromkeys(depths, 1)


def test_the_cap_forgets_the_oldest_blocks_and_counts_them() -> None:
    index = PoolBlockIndex(8)
    hashes = chat_hashes()
    index.store("a", hashes)
    assert index.size("a") == 8
    assert index.evicted["a"] == len(hashes) - 8
    assert index.holds("a", hashes[-1]) and not index.holds("a", hashes[0])


def test_a_wrong_hash_algorithm_is_noticed() -> None:
    f = ServerFeed(
        SERVER, "tcp://x:1", None, "kv", PoolBlockIndex(100), BlockHasher("sha256"), FeedStats()
    )
    seq, payload = recorded.messages()[0]
    f.accept(seq, payload)
    assert f.hash_matches is False
    assert f.stats.hash_checks["mismatch"] == 1


async def test_a_gap_without_replay_rebuilds_the_index() -> None:
    f = feed()
    msgs = recorded.messages()
    ctx = zmq.asyncio.Context()
    try:
        await f.receive(*msgs[0], ctx)
        await f.receive(*msgs[2], ctx)  # 1 was lost
    finally:
        ctx.term()
    assert f.stats.gaps[SERVER] == 1
    assert f.stats.rebuilds[SERVER] == 1
    assert f.index.matched_blocks(chat_hashes(), [SERVER]) == {SERVER: 0}  # 0's blocks: gone
    assert f.expected == 3


async def test_a_restart_clears_and_duplicates_are_skipped() -> None:
    f = feed()
    msgs = recorded.messages()
    ctx = zmq.asyncio.Context()
    try:
        for m in msgs[:4]:
            await f.receive(*m, ctx)
        size = f.index.size(SERVER)
        await f.receive(*msgs[2], ctx)  # a duplicate (a replay's overlap)
        assert f.index.size(SERVER) == size
        await f.receive(*msgs[0], ctx)  # sequence 0 again: the server restarted
    finally:
        ctx.term()
    assert f.stats.rebuilds[SERVER] == 1
    assert f.index.size(SERVER) == len(chat_hashes())


async def replaying_router(
    ctx: zmq.asyncio.Context, msgs: list[tuple[int, bytes]]
) -> tuple[zmq.asyncio.Socket, int, asyncio.Task[None]]:
    """A ROUTER that answers one replay request as vLLM's publisher does
    (``ZmqEventPublisher._service_replay``) with ``msgs``."""
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        client, _, start = await router.recv_multipart()
        for seq, payload in msgs:
            if seq >= int.from_bytes(start, "big"):
                await router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
        await router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    return router, port, asyncio.create_task(serve())


async def test_a_late_joiner_replays_what_the_server_keeps() -> None:
    msgs = recorded.messages()
    ctx = zmq.asyncio.Context()
    router, port, served = await replaying_router(ctx, msgs[:4])
    f = feed(replay=f"tcp://127.0.0.1:{port}")
    try:
        await f.receive(*msgs[3], ctx)  # the first message this feed sees is number 3
        await served
    finally:
        router.close(0)
        ctx.term()
    assert f.expected == 4
    assert f.index.size(SERVER) == len(held_by_events(recorded.batches()[:4]))


async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    """A ROUTER that answers as vLLM's publisher does (``ZmqEventPublisher._service_replay``)
    with the recorded messages."""
    msgs = recorded.messages()
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    f = feed(replay=f"tcp://127.0.0.1:{port}")

    async def serve_replay() -> None:
        client, _, start = await router.recv_multipart()
        for seq, payload in msgs:
            if seq >= int.from_bytes(start, "big"):
                await router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
        await router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    try:
        await f.receive(*msgs[0], ctx)
        server = asyncio.create_task(serve_replay())
        await f.receive(*msgs[5], ctx)  # 1-4 were lost
        await server
    finally:
        router.close(0)
        ctx.term()
    assert f.stats.gaps[SERVER] == 1 and f.stats.replays[SERVER] == 1
    assert f.stats.rebuilds[SERVER] == 1  # 010's AllBlocksCleared: the gap was filled
    assert f.expected == len(msgs)  # the replay brought everything the server keeps
    assert f.index.size(SERVER) == len(held_by_events(recorded.batches()))
