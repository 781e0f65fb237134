"""The ExampleConnector mode (KV through shared storage) with real vLLM servers, launched from
the backend config by the gateway's Launcher."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import orjson
import pytest

from backends.config import VllmBackendConfig, VllmLaunch, VllmServer
from backends.launch.launcher import Launcher
from harness.gateway import GatewayProcess
from harness.metrics import metric_value
from harness.ports import free_port
from harness.tiny_llama import build_tiny_llama
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig, ModelEntry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
async def example_pair(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmBackendConfig]:
    model = await asyncio.to_thread(build_tiny_llama, data_dir / "models" / TINY_MODEL_NAME)

    def server(role: str, core: str) -> VllmServer:
        return VllmServer(
            url=f"http://127.0.0.1:{free_port()}",
            role=role,  # type: ignore[arg-type]
            launch=VllmLaunch(cpu_cores=core, kv_cache_gib=0.25),
        )

    backend = VllmBackendConfig(
        name="tiny-example",
        served_model=TINY_MODEL_NAME,
        model_path=str(model),
        revision="test",
        connector="example",
        shared_storage_path=str(tmp_path_factory.mktemp("kv-files")),
        prefill_threshold_tokens=32,
        health_interval_s=1.0,
        cache_salt_secret="s",
        servers=[server("prefill", "0"), server("decode", "1")],
    )
    async with Launcher([backend], data_dir, progress=lambda _: None):
        yield backend


async def test_decode_loads_the_prompt_that_prefill_stored(
    example_pair: VllmBackendConfig,
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    prefill, decode = (s.url for s in example_pair.servers)
    config = GatewayConfig(
        data_dir=str(tmp_path / "data"),
        cache=False,
        models=[ModelEntry(id="tiny-chat", backend="tiny-example")],
        backends=[example_pair],
    )
    gw = start_gateway(config)
    text = f"{uuid.uuid4().hex}. " + "The cat reads a book near the window. " * 40
    body = {"model": "tiny-chat", "prompt": text, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as client:
        before = await metric_value(decode, "vllm:external_prefix_cache_hits_total")
        r = await client.post(f"{gw.url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        # vLLM publishes an engine step's stats after the answer: wait for them
        for _ in range(100):
            after = await metric_value(decode, "vllm:external_prefix_cache_hits_total")
            if after > before:
                break
            await asyncio.sleep(0.1)
        storage = Path(example_pair.storage_path())
        files = await asyncio.to_thread(lambda: list(storage.rglob("*.safetensors")))
        # the same request, computed by one server alone, answers the same
        alone = await client.post(
            f"{prefill}/v1/completions", json={**body, "model": TINY_MODEL_NAME}
        )
    assert files, "prefill wrote the KV files"
    # ExampleConnector loads whole blocks of all prompt tokens but the last
    assert after - before == (prompt_tokens - 1) // 32 * 32
    assert orjson.loads(alone.content)["choices"][0]["text"] == r.json()["choices"][0]["text"]
