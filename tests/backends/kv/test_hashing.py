"""The gateway's block hashes against those a real vLLM published, and tenant isolation."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.fleet.kv.events import BlockStored
from backends.fleet.kv.hashing import BlockHasher
from backends.fleet.kv.tokens import PromptTokenizer
from harness.tiny_llama import build_tiny_llama
from harness.vllm_process import TINY_MODEL_NAME, test_data_dir
from tests.backends.kv import recorded


def stored(index: int) -> BlockStored:
    event = recorded.batches()[index].events[-1]
    assert isinstance(event, BlockStored)
    return event


def test_every_recorded_hash_is_recomputed_exactly() -> None:
    hasher = BlockHasher("sha256_cbor")
    for batch in recorded.batches():
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            salt = event.extra_keys[0][0] if event.extra_keys and event.extra_keys[0] else None
            assert hasher.event_hashes(event.token_ids, event.block_size, salt) == (
                event.block_hashes
            )


def test_another_seed_or_algorithm_gives_other_hashes() -> None:
    event = stored(0)
    for hasher in (BlockHasher("sha256_cbor", seed="7"), BlockHasher("sha256")):
        assert not set(hasher.event_hashes(event.token_ids, 32)) & set(event.block_hashes)


def test_the_salt_changes_every_block_of_the_prefix() -> None:
    tokens = stored(0).token_ids
    hasher = BlockHasher()
    plain = hasher.event_hashes(tokens, 32)
    a = hasher.event_hashes(tokens, 32, "tenant-a")
    b = hasher.event_hashes(tokens, 32, "tenant-b")
    assert a == stored(1).block_hashes
    for one, other in ((plain, a), (a, b), (plain, b)):
        assert not set(one) & set(other)  # the salt of block 0 chains into every block


def test_only_full_blocks_are_hashed() -> None:
    tokens = stored(0).token_ids
    hasher = BlockHasher()
    assert len(hasher.event_hashes(tokens[:63], 32)) == 1
    assert hasher.event_hashes(tokens[:31], 32) == []


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    model: Path = build_tiny_llama(test_data_dir() / "models" / TINY_MODEL_NAME)
    return PromptTokenizer(model)


def test_the_chat_template_gives_the_tokens_vllm_computed(tokenizer: PromptTokenizer) -> None:
    tokens = tokenizer.prompt_tokens("/v1/chat/completions", recorded.chat_request())
    assert tokens is not None
    event = stored(0)
    assert tokens[: len(event.token_ids)] == event.token_ids
    assert BlockHasher().event_hashes(tokens, 32) == event.block_hashes


def test_completions_and_token_prompts(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.prompt_tokens("/v1/completions", {"prompt": [5, 6, 7]})
    assert ids == [5, 6, 7]
    text = tokenizer.prompt_tokens("/v1/completions", {"prompt": "hello there"})
    assert text is not None and len(text) > 1
    pictures = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert tokenizer.prompt_tokens("/v1/chat/completions", pictures) is None
