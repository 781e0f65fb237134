"""A backend's KV placement: its servers' feeds, the block index, the tokenizer, the scorer.

``KvPlacement.route`` gives a request its exact block hashes (the model's tokenizer, the
request's ``cache_salt``, the servers' hash algorithm and block size), or None, then
placement falls back to the prefix hash: the tokenizer is not loaded yet (it loads in a
thread when the backend starts), the prompt cannot be rendered as vLLM renders it, no block
size is known, or the servers' hashes are not the ones the gateway computes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from backends.chat_templates import template_path
from backends.config import VllmBackendConfig
from backends.fleet.kv.feed import PoolFeeds
from backends.fleet.kv.hashing import DEFAULT_SEED, BlockHasher
from backends.fleet.kv.index import PoolBlockIndex
from backends.fleet.kv.scoring import KvScorer
from backends.fleet.kv.tokens import PromptTokenizer
from backends.launch.command import launched_block_size

log = logging.getLogger("semcache.backends")


class KvPlacement:
    """Everything KV placement needs for one vLLM backend."""

    def __init__(self, config: VllmBackendConfig) -> None:
        settings = config.kv
        self.settings = settings
        self.index = PoolBlockIndex(settings.max_blocks_per_server)
        self.hasher = BlockHasher(settings.hash_algo, resolve_seed(config))
        self.feeds = PoolFeeds(self.index, self.hasher)
        self.scorer = KvScorer(
            self.index,
            request_cost_tokens=settings.request_cost_tokens,
            occupancy_weight=settings.occupancy_weight,
        )
        for server in config.servers:
            if server.kv_events:
                self.feeds.add(
                    server.url.rstrip("/"),
                    server.kv_events,
                    server.kv_events_replay,
                    settings.topic,
                )
        self.block_size = settings.block_size or _launched_block_size(config)
        tokenizer = settings.tokenizer or config.model_path
        self._tokenizer_dir = Path(tokenizer) if tokenizer and Path(tokenizer).is_dir() else None
        self._template = (
            template_path(config.chat_template).read_text() if config.chat_template else None
        )
        self.tokenizer: PromptTokenizer | None = None
        self._loading: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start the feeds and load the tokenizer (in a thread), once."""
        self.feeds.ensure_running()
        if self._loading is None and self._tokenizer_dir is not None:
            self._loading = asyncio.get_running_loop().create_task(self._load_tokenizer())

    async def _load_tokenizer(self) -> None:
        assert self._tokenizer_dir is not None
        try:
            self.tokenizer = await asyncio.to_thread(
                PromptTokenizer, self._tokenizer_dir, self._template
            )
        except Exception as exc:
            log.error("kv placement: no tokenizer from %s (%r)", self._tokenizer_dir, exc)

    async def ready(self) -> bool:
        """Wait for the tokenizer (tests, benchmarks); False when there is none."""
        self.ensure_running()
        if self._loading is not None:
            await self._loading
        return self.tokenizer is not None

    def hashes_match(self) -> bool:
        """No server has published a block 0 the gateway hashes differently."""
        return all(feed.hash_matches is not False for feed in self.feeds.feeds.values())

    def route(self, path: str, body: dict[str, Any]) -> tuple[tuple[int, ...], int, int] | None:
        """``(block hashes, block size, prompt tokens)`` of the request, or None."""
        if self.tokenizer is None or not self.hashes_match():
            return None
        block_size = self.block_size or self.feeds.block_size()
        if not block_size:
            return None
        tokens = self.tokenizer.prompt_tokens(path, body)
        if tokens is None:
            return None
        salt = body.get("cache_salt")
        blocks = self.hasher.event_hashes(
            tokens, block_size, salt if isinstance(salt, str) and salt else None
        )
        return tuple(blocks), block_size, len(tokens)

    def forget(self, server: str) -> None:
        """A server left: drop its feed and its blocks."""
        self.feeds.drop(server)
        self.scorer.forget(server)

    async def aclose(self) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        await self.feeds.stop()


def _launched_block_size(config: VllmBackendConfig) -> int | None:
    """The block size every launched server shares, if they do and it is known before their
    first event (the config's, or the launcher's on a CPU): placement knows a request's blocks
    from the first request on."""
    sizes = {
        launched_block_size(s.launch)
        for s in config.servers
        if s.launch is not None and s.kv_events
    }
    if len(sizes) == 1:
        (size,) = sizes
        return size
    return None


def resolve_seed(config: VllmBackendConfig) -> str:
    """The seed of the servers' ``NONE_HASH`` (see ``KvSettings.hash_seed``)."""
    if config.kv.hash_seed is not None:
        return config.kv.hash_seed
    for server in config.servers:
        if server.launch is not None and server.kv_events:
            return server.launch.env.get("PYTHONHASHSEED") or os.environ.get(
                "PYTHONHASHSEED", DEFAULT_SEED
            )
    return DEFAULT_SEED
