"""One ZMQ SUB per server, feeding a pool's block index from the server's KV events.

Each message is applied in sequence order (``ServerFeed.receive``); a feed that joins a
server which already published first asks its replay socket for everything from 0. A jump
in the sequence is a gap (the PUB socket dropped messages), filled from the server's replay
socket when it has one and still keeps the missing batches, else the server's index is
rebuilt from nothing (cleared; the next events fill it again). A sequence that starts again
at 0 is a restarted server: its index is cleared. Nothing here runs on a request's path:
placement only reads the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from backends.fleet.kv.events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_sequence,
    index_hash,
)
from backends.fleet.kv.hashing import BlockHasher
from backends.fleet.kv.index import PoolBlockIndex

log = logging.getLogger("semcache.backends")

REPLAY_WAIT_S = 2.0
"""Longest silence of a replay socket before the replay is given up (and the index rebuilt)."""


@dataclass
class FeedStats:
    """What the feeds of one pool have seen, by reason (for ``/metrics``)."""

    batches: Counter[str] = field(default_factory=Counter)
    """Batches applied per server."""
    gaps: Counter[str] = field(default_factory=Counter)
    replays: Counter[str] = field(default_factory=Counter)
    """Gaps filled from the replay socket."""
    rebuilds: Counter[str] = field(default_factory=Counter)
    """Indexes cleared: a gap that could not be filled, a restart, AllBlocksCleared."""
    bad_messages: Counter[str] = field(default_factory=Counter)
    hash_checks: Counter[str] = field(default_factory=Counter)
    """``match`` / ``mismatch``: a stored block 0 recomputed by the gateway's hasher."""


class ServerFeed:
    """The KV events of one server, applied to its pool's index."""

    def __init__(
        self,
        server: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        index: PoolBlockIndex,
        hasher: BlockHasher,
        stats: FeedStats,
    ) -> None:
        self.server = server
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.hasher = hasher
        self.stats = stats
        self.expected: int | None = None
        """The next sequence number (None before the first message)."""
        self.block_size: int | None = None
        """The server's block size, from its first ``BlockStored``."""
        self.hash_matches: bool | None = None
        """Whether the gateway's hasher reproduces this server's hashes (None: not checked)."""

    # -- the messages, in order ---------------------------------------------------------------

    def apply_batch(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self.index.remove(self.server, map(index_hash, event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                self.index.clear(self.server)
                self.stats.rebuilds[self.server] += 1
        self.stats.batches[self.server] += 1

    def _stored(self, event: BlockStored) -> None:
        if event.lora_name is not None:
            return  # LoRA blocks: requests are not hashed with adapters here
        if event.block_size:
            self.block_size = event.block_size
        if event.parent_block_hash is None and event.block_size and event.token_ids:
            salt = None
            if event.extra_keys and event.extra_keys[0]:
                salt = str(event.extra_keys[0][-1])
            first = self.hasher.event_hashes(
                event.token_ids[: event.block_size], event.block_size, salt
            )
            self.hash_matches = first[:1] == [index_hash(event.block_hashes[0])]
            self.stats.hash_checks["match" if self.hash_matches else "mismatch"] += 1
        self.index.store(self.server, map(index_hash, event.block_hashes))

    def gap(self, sequence: int) -> str:
        """What a message numbered ``sequence`` means: ``next``, ``duplicate``, ``restart``
        (its index is cleared), or ``gap`` (messages were lost before it)."""
        if self.expected is None or sequence == self.expected:
            return "next"
        if sequence == 0:
            return "restart"
        if sequence < self.expected:
            return "duplicate"
        return "gap"

    def accept(self, sequence: int, payload: bytes) -> None:
        """Apply one message known to be the next one (or the first after a rebuild)."""
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError:
            self.stats.bad_messages[self.server] += 1
            return
        self.apply_batch(batch)
        self.expected = sequence + 1

    def rebuild(self) -> None:
        """Forget this server's blocks: they are unknown until its next events."""
        self.index.clear(self.server)
        self.stats.rebuilds[self.server] += 1

    # -- the sockets ----------------------------------------------------------------------------

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        """Receive and apply until cancelled (ZMQ reconnects by itself)."""
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.stats.bad_messages[self.server] += 1
                    continue
                await self.receive(decode_sequence(frames[1]), frames[2], ctx)
        finally:
            sub.close(linger=0)

    async def receive(self, sequence: int, payload: bytes, ctx: zmq.asyncio.Context) -> None:
        if self.expected is None and sequence > 0:
            # joined a server that already published: what it still keeps comes first
            await self._replay_from(0, ctx)
            if self.expected is not None and sequence < self.expected:
                return
        state = self.gap(sequence)
        if state == "duplicate":
            return
        if state == "restart":
            self.rebuild()
        elif state == "gap":
            self.stats.gaps[self.server] += 1
            assert self.expected is not None
            if not await self._replay_from(self.expected, ctx):
                self.rebuild()
            if self.expected is not None and sequence < self.expected:
                return  # the replay brought it already
        self.accept(sequence, payload)

    async def _replay_from(self, start: int, ctx: zmq.asyncio.Context) -> bool:
        """Apply the kept batches from ``start`` on; False when the replay socket cannot give
        them (none configured, no answer, or it no longer keeps ``start``)."""
        if self.replay_endpoint is None:
            return False
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            filled = await self._apply_replayed(dealer, start)
        finally:
            dealer.close(linger=0)
        if filled:
            self.stats.replays[self.server] += 1
        return filled

    async def _apply_replayed(self, dealer: zmq.asyncio.Socket, start: int) -> bool:
        first = True
        while await dealer.poll(int(REPLAY_WAIT_S * 1000)):
            frames = await dealer.recv_multipart()
            if len(frames) != 4 or frames[2] == END_OF_REPLAY:
                return not first
            sequence = decode_sequence(frames[2])
            if first and sequence != start:
                return False  # the server no longer keeps the missing batches
            first = False
            self.accept(sequence, frames[3])
        return False


class PoolFeeds:
    """The feeds of one pool's servers: started once, stopped with the backend."""

    def __init__(self, index: PoolBlockIndex, hasher: BlockHasher) -> None:
        self.index = index
        self.hasher = hasher
        self.stats = FeedStats()
        self.feeds: dict[str, ServerFeed] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None

    def add(self, server: str, endpoint: str, replay: str | None, topic: str) -> ServerFeed:
        feed = ServerFeed(server, endpoint, replay, topic, self.index, self.hasher, self.stats)
        self.feeds[server] = feed
        if self._ctx is not None:
            self._start(feed)
        return feed

    def drop(self, server: str) -> None:
        """A server left the pool: stop its feed and forget its blocks."""
        self.feeds.pop(server, None)
        task = self._tasks.pop(server, None)
        if task is not None:
            task.cancel()
        self.index.clear(server)

    def ensure_running(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            for feed in self.feeds.values():
                self._start(feed)

    def _start(self, feed: ServerFeed) -> None:
        assert self._ctx is not None
        task = asyncio.get_running_loop().create_task(feed.run(self._ctx))
        task.add_done_callback(lambda t: self._ended(feed.server, t))
        self._tasks[feed.server] = task

    def _ended(self, server: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("kv events of %s stopped: %r", server, task.exception())

    def block_size(self) -> int | None:
        """The pool's block size, once a server has reported one."""
        return next((f.block_size for f in self.feeds.values() if f.block_size), None)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
