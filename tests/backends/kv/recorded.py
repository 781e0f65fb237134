"""The KV events a real vLLM 0.32 (CPU build, tiny Llama, block size 32, KV for 4,096 tokens,
``sha256_cbor``) published, recorded by ``bench/diagnostics/kv_events_probe.py``:

- 000: the chat request of ``chat.json`` (19 full blocks); its repeat was a prefix-cache hit
  and published nothing;
- 001: the same request with ``cache_salt: "tenant-a"``;
- 002-009: eight other long prompts; from 006 on the KV is full and vLLM evicts
  (``BlockRemoved``);
- 010: ``POST /reset_prefix_cache`` (``AllBlocksCleared``, published with the next step),
  then the chat request again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from backends.fleet.kv.events import EventBatch, decode_batch, decode_sequence

DIR = Path(__file__).resolve().parents[1] / "data" / "kv_events"
BLOCK_SIZE = 32
KV_BLOCKS = 4096 // BLOCK_SIZE
"""The recording server's KV capacity in blocks."""


def messages() -> list[tuple[int, bytes]]:
    """``(sequence, payload)`` of every recorded message, in order."""
    return [
        (decode_sequence(p.with_suffix(".seq").read_bytes()), p.read_bytes())
        for p in sorted(DIR.glob("*.msgpack"))
    ]


def batches() -> list[EventBatch]:
    return [decode_batch(payload) for _, payload in messages()]


def chat_request() -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads((DIR / "chat.json").read_bytes())
    return body
