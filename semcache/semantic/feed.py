"""Sharing semantic entries between gateways, so one gateway's writes become findable by all.

``EntryFeed`` is the small protocol the cache needs; ``RedisEntryFeed`` implements it on a
Redis stream (bounded by an approximate MAXLEN). A stream rather than pub/sub: a gateway
whose connection drops resumes from the last id it read and loses nothing still in the
stream; a new gateway may replay the stream to warm its index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol

import msgspec

from semcache.semantic.records import SemanticRecord

log = logging.getLogger(__name__)

RecordSink = Callable[[list[SemanticRecord]], Awaitable[None]]
FeedEvent = Literal["published", "received", "publish_failed", "read_failed"]
FeedObserver = Callable[[FeedEvent, int], None]
"""Told of each batch of records published or received, and of each failed publish or read
(with the number of records it concerned; 0 for a read)."""


class EntryFeed(Protocol):
    """Publishes this gateway's new semantic entries and delivers other gateways' ones."""

    async def publish(self, records: Sequence[SemanticRecord]) -> None: ...

    async def subscribe(self, sink: RecordSink) -> None:
        """Start delivering other gateways' records to sink (returns once listening)."""
        ...

    async def aclose(self) -> None: ...


class RedisEntryFeed:
    """An ``EntryFeed`` on a Redis stream, via ``redis.asyncio``."""

    def __init__(
        self,
        redis: Any,
        *,
        stream: str = "semcache:semantic:entries",
        origin: str | None = None,
        max_len: int = 100_000,
        block_ms: int = 250,
        read_count: int = 512,
        replay: bool = False,
        start_id: str | None = None,
        observer: FeedObserver | None = None,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.origin = origin or uuid.uuid4().hex
        self.max_len = max_len
        self.block_ms = block_ms
        self.read_count = read_count
        self.replay = replay
        """Deliver the records already in the stream on subscribe (warm a new gateway)."""
        self.start_id = start_id
        """Resume after this stream id (a restarted gateway's saved cursor); wins over replay."""
        self.last_id: str | None = None
        """The id of the last message read (delivered to the sink or skipped)."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(SemanticRecord)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._observe: FeedObserver = observer or _ignore
        self.delivered = 0

    async def publish(self, records: Sequence[SemanticRecord]) -> None:
        if not records:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                record.origin = self.origin
                pipe.xadd(
                    self.stream,
                    {"r": self._encoder.encode(record)},
                    maxlen=self.max_len,
                    approximate=True,
                )
            try:
                await pipe.execute()
            except Exception:
                self._observe("publish_failed", len(records))
                raise
        self._observe("published", len(records))

    async def subscribe(self, sink: RecordSink) -> None:
        if self._task is not None:
            raise RuntimeError("already subscribed")
        if self.start_id is not None:
            last_id = self.start_id
        else:
            last_id = "0-0" if self.replay else await self._tail_id()
        self.last_id = last_id
        self._task = asyncio.create_task(self._read_loop(sink, last_id), name="semantic-feed")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        self._closing = True
        if task is None:
            return
        task.cancel()
        # A read cancelled inside redis-py can wait on the client's shared connection
        # machinery (another reader of the same client); do not wait for it forever.
        done, _ = await asyncio.wait({task}, timeout=self.block_ms / 1000.0 * 4 + 1.0)
        if not done:
            log.warning("semantic feed: the reader did not stop in time; left to finish")
            return
        with contextlib.suppress(asyncio.CancelledError):
            task.result()

    async def _tail_id(self) -> str:
        newest = await self.redis.xrevrange(self.stream, count=1)
        if not newest:
            return "0-0"
        return _text(newest[0][0])

    async def _read_loop(self, sink: RecordSink, last_id: str) -> None:
        backoff = 0.1
        while True:
            try:
                reply = await self.redis.xread(
                    {self.stream: last_id}, count=self.read_count, block=self.block_ms
                )
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection loss: retry from the same id
                if self._closing:
                    # redis-py may turn the cancellation of a blocked read into a connection
                    # error: retrying would outlive aclose, which waits for this task.
                    return
                log.warning("semantic feed read failed (%s); retrying in %.1fs", exc, backoff)
                self._observe("read_failed", 0)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            records: list[SemanticRecord] = []
            for _stream, messages in reply or []:
                for message_id, fields in messages:
                    last_id = _text(message_id)
                    payload = fields.get(b"r") if b"r" in fields else fields.get("r")
                    if payload is None:
                        continue
                    try:
                        record = self._decoder.decode(payload)
                    except msgspec.DecodeError:
                        log.warning("semantic feed: undecodable message %s", last_id)
                        continue
                    if record.origin != self.origin:
                        records.append(record)
            if records:
                try:
                    await sink(records)
                    self.delivered += len(records)
                    self._observe("received", len(records))
                except Exception:
                    log.exception("semantic feed: adding %d records failed", len(records))
            self.last_id = last_id


def _ignore(event: FeedEvent, count: int) -> None:
    pass


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
