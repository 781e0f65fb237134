"""VllmClient's load report (read by the batch workers' capacity gates), on the real tiny vLLM."""

from __future__ import annotations

import pytest

from backends.config import VllmBackendConfig, VllmServer
from backends.launch.process import VllmProcess
from backends.vllm.client import VllmClient
from foundation.request import RequestContext
from harness.vllm_process import TINY_MODEL_NAME


@pytest.mark.slow
async def test_inflight_and_capacity_follow_open_requests(tiny_vllm: VllmProcess) -> None:
    client = VllmClient(
        VllmBackendConfig(
            name="tiny", served_model=TINY_MODEL_NAME, servers=[VllmServer(url=tiny_vllm.url)]
        )
    )
    body = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
    }
    try:
        assert client.inflight() == 0 and client.has_capacity(1)
        stream = await client.open_stream(
            "/v1/chat/completions", body, RequestContext(request_id="r1")
        )
        assert client.inflight() == 1
        assert not client.has_capacity(1) and client.has_capacity(2) and client.has_capacity()
        await stream.read_all()
        assert client.inflight() == 0 and client.has_capacity(1)
        reply = await client.post(
            "/v1/chat/completions", {**body, "stream": False}, RequestContext(request_id="r2")
        )
        assert reply.status == 200 and client.inflight() == 0
    finally:
        await client.aclose()
