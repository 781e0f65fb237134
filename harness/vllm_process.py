"""Real vLLM servers of the tiny Llama for tests and benchmarks, and where they keep their files."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from backends.config import ServerRole, VllmLaunch, VllmServer
from backends.launch.process import Progress, VllmProcess
from harness.tiny_llama import TOOL_CALL_PARSER, build_tiny_llama

TINY_MODEL_NAME = "tiny-llama"
TOOL_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    TOOL_CALL_PARSER,
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)
TOOL_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
"""Tool calling on the tiny servers, with the parser that reads their template's calls. A
required or named call is guided JSON of the tools' schemas (vLLM's own form, not the
parser's structural tag, whose arguments xgrammar leaves free of the schema and of the
compact setting) and guided JSON is compact: random weights otherwise write numbers or
whitespace until ``max_tokens`` runs out (checked against vLLM 0.32)."""
SINGLE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SINGLE_PROCESS_ARGS = ("--distributed-executor-backend", "uni")
"""vLLM's one worker inside its engine-core process (vLLM's layout for one device on a GPU;
its CPU platform keeps a separate worker unless multiprocessing is off). Two interpreters
import torch and vLLM instead of three: a tiny server, or a prefill/decode pair with NIXL,
is ready in about 0.6 of the time on a CPU. The API server stays its own process.
Launched servers (``semcache serve``) keep vLLM's own layout, as users run them."""


def single_process_launch(**fields: Any) -> VllmLaunch:
    """A ``VllmLaunch`` of ``fields`` whose server runs as ``SINGLE_PROCESS_ARGS`` say: for
    launched servers of tests whose process layout is not what they prove."""
    extra_args = [*SINGLE_PROCESS_ARGS, *fields.pop("extra_args", ())]
    env = {**SINGLE_PROCESS_ENV, **fields.pop("env", {})}
    return VllmLaunch(extra_args=extra_args, env=env, **fields)


REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout this package runs from (tests and benchmarks run from one)."""


def test_data_dir() -> Path:
    """Where slow tests keep models and logs across runs (``SEMCACHE_TEST_DATA_DIR``)."""
    return Path(os.environ.get("SEMCACHE_TEST_DATA_DIR", REPO_ROOT / ".data" / "test"))


test_data_dir.__test__ = False  # type: ignore[attr-defined]  # not a test, despite the name


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
    single_process: bool = True,
    timeout_s: float = 600.0,
    progress: Progress | None = print,
    traces_endpoint: str | None = None,
) -> VllmProcess:
    """Start vLLM serving the tiny Llama on 127.0.0.1:``port`` and wait until it is healthy.

    ``single_process`` (any role) runs it as ``SINGLE_PROCESS_ARGS`` say.

    The caller owns the process: ``await process.stop()`` when done. If it never becomes
    healthy, it is stopped and ``VllmStartError`` (with the log tail) is raised.
    """
    model = await tiny_llama(data_dir)
    launch = single_process_launch if single_process else VllmLaunch
    server = VllmServer(
        url=f"http://127.0.0.1:{port}",
        role=role,
        launch=launch(
            cpu_cores=cpu_cores,
            kv_cache_gib=kv_cache_gib,
            block_size=block_size,
            max_model_len=max_model_len,
            nixl_side_channel_port=nixl_side_channel_port,
            extra_args=[*TOOL_ARGS, *extra_args],
            env={**TOOL_ENV, **(env or {})},
        ),
    )
    process = VllmProcess(
        model=model,
        served_model=served_model,
        server=server,
        data_dir=data_dir,
        traces_endpoint=traces_endpoint,
    )
    process.start()
    try:
        await process.wait_ready(timeout_s, progress)
    except BaseException:
        await process.stop()
        raise
    return process
