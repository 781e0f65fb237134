"""vLLM's KV events as they arrive on the wire (vLLM 0.32 ``vllm/distributed/kv_events.py``).

A ZMQ message is ``(topic, sequence as 8 big-endian bytes, msgpack payload)``; the payload is
an event batch, an array ``[ts, events, data_parallel_rank]`` whose events are maps tagged by
``"type"``. These structs mirror vLLM's own (the gateway does not import vLLM) and ignore the
fields placement has no use for; unknown fields are skipped, so newer servers decode too.
"""

from __future__ import annotations

from typing import Any

import msgspec

WireHash = int | bytes
"""vLLM's ``ExternalBlockHash``: a 64-bit int by default, the 32-byte hash when the server
runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``."""

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's last message."""


class BlockStored(msgspec.Struct, tag="BlockStored", kw_only=True):
    """Full blocks a server cached: their hashes in order, after ``parent_block_hash``."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    """One entry per block: the untagged extra keys (block 0 of a salted request: [salt])."""
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", kw_only=True):
    """Blocks a server evicted."""

    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    """The server's prefix cache was reset: it holds nothing now."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    """The events of one engine step."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """One message's payload as a batch (raises ``msgspec.DecodeError`` on a bad one)."""
    return _decoder.decode(payload)


def decode_sequence(frame: bytes) -> int:
    """The sequence number of one message (-1 ends a replay)."""
    return int.from_bytes(frame, "big", signed=True)


def index_hash(value: WireHash) -> int:
    """A wire hash as the index keys it: the 64-bit int vLLM publishes by default (a 32-byte
    hash is cut to its low 64 bits as vLLM does: ``maybe_convert_block_hash``)."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & 0xFFFF_FFFF_FFFF_FFFF
    return value
