"""vLLM's KV events decoded from real recorded messages (``recorded.py``)."""

from __future__ import annotations

import msgspec
import pytest

from backends.fleet.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    index_hash,
)
from tests.backends.kv import recorded


def test_recorded_messages_are_numbered_from_zero_without_gaps() -> None:
    sequences = [seq for seq, _ in recorded.messages()]
    assert sequences == list(range(len(sequences)))


def test_block_stored_carries_hashes_tokens_and_the_salt() -> None:
    first, salted = recorded.batches()[:2]
    (stored,) = first.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None
    assert stored.block_size == recorded.BLOCK_SIZE
    assert len(stored.token_ids) == len(stored.block_hashes) * stored.block_size
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored.block_hashes)
    assert stored.medium == "GPU"  # vLLM's primary pool, even on the CPU build
    assert stored.extra_keys is not None and not any(stored.extra_keys)
    (salted_stored,) = salted.events
    assert isinstance(salted_stored, BlockStored)
    assert salted_stored.extra_keys is not None
    assert salted_stored.extra_keys[0] == ["tenant-a"]
    assert not any(salted_stored.extra_keys[1:])
    assert salted_stored.token_ids == stored.token_ids
    assert not set(salted_stored.block_hashes) & set(stored.block_hashes)


def test_eviction_and_reset_arrive_as_their_own_events() -> None:
    kinds = [[type(e) for e in b.events] for b in recorded.batches()]
    assert all(k == [BlockStored] for k in kinds[:6])  # the KV is not full yet
    assert all(BlockRemoved in k and k[-1] is BlockStored for k in kinds[6:10])
    assert kinds[10] == [AllBlocksCleared, BlockStored]


def test_a_bad_payload_raises_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\x93\x01")


def test_index_hash_cuts_a_full_hash_as_vllm_does() -> None:
    full = bytes(range(32))
    assert index_hash(full) == int.from_bytes(full[-8:], "big")
    assert index_hash(12345) == 12345
