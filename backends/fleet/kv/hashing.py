"""vLLM's prefix-cache block hashes, recomputed by the gateway (vLLM 0.32
``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``init_none_hash``,
``generate_block_hash_extra_keys``).

Block ``i`` hashes ``(parent, tokens, extra)``: the previous block's 32-byte hash (block 0:
``NONE_HASH``, the hash of the seed), the block's token ids as a tuple, and ``None`` or the
block's tagged extra keys; block 0 of a request with a ``cache_salt`` has
``(("cache_salt", salt),)``. Only full blocks are hashed. The hash function is the server's
``--prefix-caching-hash-algo``: ``sha256_cbor`` (canonical CBOR, what launched servers use:
the same bytes from any Python) or ``sha256`` (vLLM's default: the pickle of the tuple).
The seed is the server's ``PYTHONHASHSEED``, else ``vllm-none-hash``. KV events publish the
low 64 bits of each hash as an int (``to_event_hash``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

from backends.kv_settings import HashAlgo

DEFAULT_SEED = "vllm-none-hash"
"""vLLM's seed for ``NONE_HASH`` when ``PYTHONHASHSEED`` is unset (SHA-256 algorithms)."""


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


HASH_FUNCTIONS: dict[HashAlgo, Callable[[Any], bytes]] = {
    "sha256_cbor": _sha256_cbor,
    "sha256": _sha256_pickle,
}


def to_event_hash(block_hash: bytes) -> int:
    """A 32-byte block hash as KV events publish it (``maybe_convert_block_hash``)."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


class BlockHasher:
    """The block hashes a vLLM server computes for a prompt's token ids."""

    def __init__(self, algo: HashAlgo = "sha256_cbor", seed: str = DEFAULT_SEED) -> None:
        self.algo = algo
        self._hash = HASH_FUNCTIONS[algo]
        self.none_hash = self._hash(seed)

    def block_hashes(
        self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
    ) -> list[bytes]:
        """The 32-byte hash of every full block of ``token_ids``."""
        hashes: list[bytes] = []
        parent = self.none_hash
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = self._hash((parent, tuple(token_ids[start : start + block_size]), extra))
            hashes.append(parent)
        return hashes

    def event_hashes(
        self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
    ) -> list[int]:
        """``block_hashes`` as KV events name them."""
        return [to_event_hash(h) for h in self.block_hashes(token_ids, block_size, cache_salt)]
