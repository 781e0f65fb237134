"""Starting and stopping real vLLM servers from the backend config."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import psutil
import pytest

from backends.config import ServerRole, VllmBackendConfig, VllmLaunch, VllmServer
from backends.launch.command import build_command
from backends.launch.launcher import Launcher
from backends.launch.process import VllmProcess, VllmStartError
from backends.launch.process_group import process_group_members
from harness.metrics import metric_value
from harness.ports import free_port
from harness.tiny_llama import build_tiny_llama
from harness.vllm_process import TINY_MODEL_NAME

MODEL = Path("/models/m")


def flag_value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def server(role: ServerRole = "both", **launch: Any) -> VllmServer:
    return VllmServer(url="http://127.0.0.1:8123", role=role, launch=VllmLaunch(**launch))


def test_cpu_prefill_command_carries_the_cpu_flags_and_producer_role() -> None:
    srv = server("prefill", cpu_cores="1", kv_cache_gib=2, nixl_side_channel_port=5611)
    cmd, env = build_command(model=MODEL, served_model="m", server=srv, device="cpu", python="/py")
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(cmd, "--model") == str(MODEL)
    assert flag_value(cmd, "--served-model-name") == "m"
    assert flag_value(cmd, "--host") == "127.0.0.1"
    assert flag_value(cmd, "--port") == "8123"
    assert flag_value(cmd, "--block-size") == "32"
    assert flag_value(cmd, "--max-model-len") == "2048"
    assert flag_value(cmd, "--disable-access-log-for-endpoints") == "/health,/metrics"
    for flag in ("--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in cmd
    assert orjson.loads(flag_value(cmd, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 30},  # spelled out, vLLM's default
    }
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5611"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_gpu_decode_command_leaves_out_the_cpu_only_flags() -> None:
    srv = server("decode", cpu_cores="0", kv_cache_gib=2)
    cmd, env = build_command(
        model=MODEL, served_model="m", server=srv, device="cuda", python="p", kv_lease_s=12
    )
    assert orjson.loads(flag_value(cmd, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"kv_lease_duration": 12},
    }
    for flag in ("--enforce-eager", "--block-size", "--kv-cache-memory-bytes"):
        assert flag not in cmd
    for var in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        assert var not in env
    assert "--enable-prefix-caching" in cmd


def test_command_options_from_launch() -> None:
    srv = server(
        kv_cache_gib=0.25,
        block_size=64,
        max_model_len=None,
        enforce_eager=False,
        extra_args=["--kv-transfer-config", '{"kv_connector":"ExampleConnector"}'],
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    )
    cmd, env = build_command(model=MODEL, served_model="m", server=srv, device="cpu", python="p")
    assert flag_value(cmd, "--kv-cache-memory-bytes") == str(1 << 28)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert flag_value(cmd, "--block-size") == "64"
    assert "--max-model-len" not in cmd
    assert "--enforce-eager" not in cmd
    assert cmd.count("--kv-transfer-config") == 1  # extra_args win over the role's default
    assert "kv-transfer" not in " ".join(cmd[: cmd.index("--kv-transfer-config")])
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert (
        "--kv-transfer-config"
        not in build_command(
            model=MODEL, served_model="m", server=server(), device="cpu", python="p"
        )[0]
    )


def test_tracing_gives_vllm_the_endpoint_over_otlp_http_and_its_role_as_service() -> None:
    endpoint = "http://127.0.0.1:4318/v1/traces"
    cmd, env = build_command(
        model=MODEL,
        served_model="m",
        server=server("decode"),
        device="cpu",
        python="p",
        traces_endpoint=endpoint,
    )
    assert flag_value(cmd, "--otlp-traces-endpoint") == endpoint
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"] == "vllm-decode"
    untraced, env = build_command(
        model=MODEL, served_model="m", server=server("decode"), device="cpu", python="p"
    )
    assert "--otlp-traces-endpoint" not in untraced
    assert not any(name.startswith("OTEL_") for name in env)
    own = server("both", extra_args=["--otlp-traces-endpoint", "http://elsewhere/v1/traces"])
    cmd, _ = build_command(
        model=MODEL,
        served_model="m",
        server=own,
        device="cpu",
        python="p",
        traces_endpoint=endpoint,
    )
    assert cmd.count("--otlp-traces-endpoint") == 1  # the operator's own flag wins


def test_server_url_needs_a_port() -> None:
    with pytest.raises(ValueError, match="explicit host and port"):
        build_command(
            model=MODEL,
            served_model="m",
            server=VllmServer(url="http://127.0.0.1", launch=VllmLaunch()),
            device="cpu",
            python="p",
        )


def test_start_refuses_a_port_already_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        process = VllmProcess(
            model=MODEL,
            served_model="m",
            server=VllmServer(url=f"http://127.0.0.1:{port}", launch=VllmLaunch()),
            data_dir=tmp_path,
            device="cpu",
        )
        with pytest.raises(VllmStartError, match="port is in use"):
            process.start()
    assert process.pid is None


def family(process: VllmProcess) -> list[int]:
    """The pids of a running server: its leader and every descendant."""
    assert process.pid is not None
    leader = psutil.Process(process.pid)
    return [leader.pid, *(child.pid for child in leader.children(recursive=True))]


def assert_all_gone(pids: list[int], pgid: int, within_s: float = 15.0) -> None:
    """Every process is gone (or a zombie) within ``within_s``: a loaded machine reaps slowly."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if (not alive and not process_group_members(pgid)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert alive == []
    assert process_group_members(pgid) == []


@pytest.mark.slow
async def test_tiny_server_answers_models_and_chat(tiny_vllm: VllmProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{tiny_vllm.url}/v1", api_key="x", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [TINY_MODEL_NAME]
        answer = await client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=[{"role": "user", "content": "Tell me about the river."}],
            max_tokens=8,
            temperature=0,
        )
    finally:
        await client.close()
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage is not None
    assert answer.usage.completion_tokens > 0
    assert answer.usage.prompt_tokens > 0


@pytest.mark.slow
async def test_metric_value_reads_prefix_cache_hits(tiny_vllm: VllmProcess) -> None:
    prompt = f"{uuid.uuid4()} " + "The cat reads a book near the window. " * 20
    body = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1,
    }
    url = tiny_vllm.url
    async with httpx.AsyncClient(timeout=60) as client:
        await client.post(f"{url}/v1/chat/completions", json=body)
        hits = await metric_value(url, "vllm:prefix_cache_hits_total", client=client)
        by_source = await metric_value(
            url, "vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}, client
        )
        second = (await client.post(f"{url}/v1/chat/completions", json=body)).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        for _ in range(50):  # the counters may trail the response by a moment
            new_hits = await metric_value(url, "vllm:prefix_cache_hits_total", client=client)
            if new_hits > hits:
                break
            await asyncio.sleep(0.1)
        new_by_source = await metric_value(
            url, "vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}, client
        )
    assert new_hits - hits == cached
    assert new_by_source - by_source == cached


@pytest.mark.slow
async def test_launcher_runs_a_prefill_decode_pair_and_stops_everything(data_dir: Path) -> None:
    model = await asyncio.to_thread(build_tiny_llama, data_dir / "models" / TINY_MODEL_NAME)

    def pd_server(role: ServerRole, core: str) -> VllmServer:
        return VllmServer(
            url=f"http://127.0.0.1:{free_port()}",
            role=role,
            launch=VllmLaunch(cpu_cores=core, kv_cache_gib=1, nixl_side_channel_port=free_port()),
        )

    backend = VllmBackendConfig(
        name="tiny-pd",
        served_model=TINY_MODEL_NAME,
        model_path=str(model),
        servers=[pd_server("prefill", "0"), pd_server("decode", "1")],
    )
    notes: list[str] = []
    pids: dict[str, list[int]] = {}
    with pytest.raises(RuntimeError, match="leaving the block on an error"):
        async with Launcher([backend], data_dir, progress=notes.append) as launcher:
            prefill, decode = launcher.processes
            assert launcher.model_paths == {"tiny-pd": model}
            pids = {"prefill": family(prefill), "decode": family(decode)}
            # The roles work together: the decode server pulls the prompt's KV over NIXL.
            prompt = f"{uuid.uuid4()} " + "A bird visits the old tree every day. " * 20
            body = {"model": TINY_MODEL_NAME, "prompt": prompt, "temperature": 0}
            async with httpx.AsyncClient(timeout=120) as client:
                before = await metric_value(
                    decode.url, "vllm:external_prefix_cache_hits_total", client=client
                )
                first = await client.post(
                    f"{prefill.url}/v1/completions",
                    json={
                        **body,
                        "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True},
                    },
                )
                params = first.json()["kv_transfer_params"]
                assert params["do_remote_prefill"] is True
                second = await client.post(
                    f"{decode.url}/v1/completions",
                    json={**body, "max_tokens": 4, "kv_transfer_params": params},
                )
                assert second.status_code == 200
                # vLLM publishes an engine step's stats after the answer: wait for them
                for _ in range(100):
                    after = await metric_value(
                        decode.url, "vllm:external_prefix_cache_hits_total", client=client
                    )
                    if after > before:
                        break
                    await asyncio.sleep(0.1)
            assert after > before

            prefill.kill()  # a crash: all its processes are gone at once
            assert_all_gone(pids["prefill"], pids["prefill"][0])
            raise RuntimeError("leaving the block on an error")
    assert any("waiting for vLLM" in note or "ready" in note for note in notes)
    assert_all_gone(pids["decode"], pids["decode"][0])


@pytest.mark.slow
async def test_launcher_fails_fast_with_the_log_tail_and_stops_the_rest(data_dir: Path) -> None:
    model = await asyncio.to_thread(build_tiny_llama, data_dir / "models" / TINY_MODEL_NAME)
    good = VllmServer(url=f"http://127.0.0.1:{free_port()}", launch=VllmLaunch(cpu_cores="0"))
    broken = VllmServer(
        url=f"http://127.0.0.1:{free_port()}",
        launch=VllmLaunch(cpu_cores="1", extra_args=["--no-such-flag"]),
    )
    backend = VllmBackendConfig(
        name="tiny-broken",
        served_model=TINY_MODEL_NAME,
        model_path=str(model),
        servers=[good, broken],
    )
    launcher = Launcher([backend], data_dir, progress=lambda _: None, ready_timeout_s=600)
    with pytest.raises(VllmStartError) as failure:
        await launcher.start()
    message = str(failure.value)
    assert "exited with code" in message
    assert "--no-such-flag" in message  # the log tail says what went wrong
    for process in launcher.processes:
        assert process.returncode is not None
        assert process.pid is not None
        assert process_group_members(process.pid) == []
