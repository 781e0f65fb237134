"""Burn a set share of one core with gateway-like Python work (JSON, hashing, dicts).

The control of ``overhead.py --control``: direct traffic while this burns, on the client's
core, the CPU share the gateway used, asks whether that CPU alone (on the core next to
vLLM's) costs vLLM throughput, rather than the gateway holding requests back.

    .venv/bin/python bench/lib/cpu_burn.py FRACTION   # 0.07: 0.35 ms busy every 5 ms
"""

from __future__ import annotations

import hashlib
import sys
import time

import orjson

PERIOD_S = 0.005
BODY = {
    "id": "chatcmpl-0",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 60}}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 64, "total_tokens": 104},
}


def burn(fraction: float) -> None:
    """Busy for ``fraction`` of every 5 ms period, asleep for the rest, until killed."""
    while True:
        started = time.perf_counter()
        busy_until = started + fraction * PERIOD_S
        while time.perf_counter() < busy_until:
            raw = orjson.dumps(BODY)
            parsed = orjson.loads(raw)
            hashlib.sha256(raw).hexdigest()
            _ = {key: value for key, value in parsed.items()}
        time.sleep(max(0.0, started + PERIOD_S - time.perf_counter()))


if __name__ == "__main__":
    burn(min(1.0, max(0.0, float(sys.argv[1]))))
