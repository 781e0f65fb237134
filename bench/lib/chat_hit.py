"""One fixed chat request that an exact hit answers (the early-hit path), and the fake vLLM
behind it: the wrk runs of ``tracing_cost.py`` and ``many_api_keys.py``, where the model
stays out of the figures (hits never reach it; misses cost it the same for every target)."""

from __future__ import annotations

import orjson

from bench.lib.support import GATEWAY_MODEL_ID
from harness.fake_vllm import FakeVllm

SERVED = "bench-model"
"""The fake's served model name."""
MESSAGES = [{"role": "user", "content": "What is the capital of France? One sentence."}]
HIT_BODY = orjson.dumps(
    {"model": GATEWAY_MODEL_ID, "messages": MESSAGES, "temperature": 0, "max_tokens": 16}
)


def fake_vllm() -> FakeVllm:
    """A local server in this process answering like vLLM (one fixed answer), started."""
    return FakeVllm(SERVED, text="Paris is the capital of France.", usage=(20, 8)).start()
