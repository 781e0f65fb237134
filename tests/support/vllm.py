"""Helpers for tests that run real vLLM servers: the tiny model, free ports, /metrics values."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from backends.config import ServerRole, VllmLaunch, VllmServer
from backends.launch import Progress, VllmProcess
from tests.support.tiny_llama import build_tiny_llama

TINY_MODEL_NAME = "tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_data_dir() -> Path:
    """Where slow tests keep models and logs across runs (``SEMCACHE_TEST_DATA_DIR``)."""
    return Path(os.environ.get("SEMCACHE_TEST_DATA_DIR", REPO_ROOT / ".data" / "test"))


test_data_dir.__test__ = False  # type: ignore[attr-defined]  # not a test, despite the name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def tiny_llama(data_dir: Path) -> Path:
    """The tiny model folder under ``data_dir/models`` (built once)."""
    return await asyncio.to_thread(build_tiny_llama, data_dir / "models" / TINY_MODEL_NAME)


async def start_tiny_vllm(
    data_dir: Path,
    port: int,
    role: ServerRole = "both",
    cpu_cores: str | None = None,
    *,
    served_model: str = TINY_MODEL_NAME,
    kv_cache_gib: float = 1.0,
    block_size: int | None = None,
    max_model_len: int = 2048,
    nixl_side_channel_port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    progress: Progress | None = print,
) -> VllmProcess:
    """Start vLLM serving the tiny Llama on 127.0.0.1:``port`` and wait until it is healthy.

    The caller owns the process: ``await process.stop()`` when done. If it never becomes
    healthy, it is stopped and ``VllmStartError`` (with the log tail) is raised.
    """
    model = await tiny_llama(data_dir)
    server = VllmServer(
        url=f"http://127.0.0.1:{port}",
        role=role,
        launch=VllmLaunch(
            cpu_cores=cpu_cores,
            kv_cache_gib=kv_cache_gib,
            block_size=block_size,
            max_model_len=max_model_len,
            nixl_side_channel_port=nixl_side_channel_port,
            extra_args=list(extra_args),
            env=dict(env or {}),
        ),
    )
    process = VllmProcess(model=model, served_model=served_model, server=server, data_dir=data_dir)
    process.start()
    try:
        await process.wait_ready(timeout_s, progress)
    except BaseException:
        await process.stop()
        raise
    return process


def parse_metric(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples called ``name`` (e.g. ``vllm:prefix_cache_hits_total``) in a
    Prometheus text page, over all label sets, or only those carrying ``labels``."""
    wanted = dict(labels or {})
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != name:
                continue
            if all(sample.labels.get(key) == value for key, value in wanted.items()):
                total += sample.value
    return total


async def metric_value(
    base_url: str,
    name: str,
    labels: Mapping[str, str] | None = None,
    client: httpx.AsyncClient | None = None,
) -> float:
    """``parse_metric`` on the live ``/metrics`` page of the server at ``base_url``."""
    url = f"{base_url.rstrip('/')}/metrics"
    if client is not None:
        response = await client.get(url)
    else:
        async with httpx.AsyncClient(timeout=10.0) as own:
            response = await own.get(url)
    response.raise_for_status()
    return parse_metric(response.text, name, labels)
