"""Starting the servers compared: vLLM (or a running one), the gateway with tenancy off and
on, the bare app and LiteLLM's proxy, each pinned, each stopped when the run ends; and
py-spy on the gateway."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

from backends.config import VllmLaunch, VllmServer
from backends.launch.process import VllmProcess
from backends.launch.process_group import die_with_parent_hook
from bench.lib.exact_hit.bare_app import canned_replies
from bench.lib.exact_hit.litellm_proxy import litellm_config
from bench.lib.exact_hit.targets import NOT_HITS, Target, not_hits, prime
from bench.lib.exact_hit.workload import CHAT_KINDS, MASTER_KEY
from bench.lib.support import (
    GATEWAY_ENV,
    REPO,
    ServerProcess,
    affinity,
    child_env,
    gateway_ready,
    gateway_toml,
    parse_cores,
    served_model_of,
    stderr_printer,
    stop_gateway,
    toml_value,
)
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, tiny_llama
from server.config import GatewayConfig, load_config

ENTRY_SCRIPT = str(REPO / "bench" / "exact_hit.py")
"""Run with ``--serve-bare``, it serves the bare app."""

say = stderr_printer("exact_hit")


def tenancy_toml(on: bool) -> str:
    """A gateway's tenancy tables: all off (target a), or all on (a2): a listed token, limits
    that every request goes through and none reaches (requests and tokens per minute, with
    the body read ahead and the usage reconciled; concurrency; a daily USD budget read from
    the ledger), the usage ledger and the request log (to its file)."""
    ledger = "ledger" in GatewayConfig.__struct_fields__  # the ledger's own config table
    if not on:
        lines = ["[request_log]", "enabled = false"]
        return "\n".join(lines + (["[ledger]", "enabled = false"] if ledger else [])) + "\n"
    lines = ["[request_log]", "enabled = true", "[limits]", "requests_per_minute = 1_000_000_000"]
    lines += ["tokens_per_minute = 1_000_000_000_000", "concurrent_requests = 100_000"]
    if ledger:
        lines += ["daily_usd = 1_000_000.0", "[ledger]", "enabled = true"]
    lines += ["[[auth.tokens]]", f"token = {toml_value(MASTER_KEY)}", 'tenant = "bench"']
    return "\n".join(lines) + "\n"


@dataclass
class Backend:
    """The vLLM every cache is filled from (once per target)."""

    url: str
    served: str
    model_path: Path | None
    note: str
    process: VllmProcess | None = None


class Bench:
    """Starts the servers and the clients, and stops them all when the run ends."""

    def __init__(self, args: argparse.Namespace, stack: contextlib.AsyncExitStack, tmp: Path):
        self.args, self.stack, self.tmp = args, stack, tmp
        self.server_cores = None if args.server_core == "none" else parse_cores(args.server_core)

    def client(self) -> httpx.AsyncClient:
        """For priming and checks only (wrk sends the load)."""
        client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0))
        self.stack.push_async_callback(client.aclose)
        return client

    def child(self, name: str, argv: list[str], url: str, cwd: Path, **env: str) -> ServerProcess:
        log = self.tmp / f"{name.split()[0].lower()}.log"
        child = ServerProcess(name, argv, url, log, child_env(**env), cwd)
        self.start(child)
        return child

    def start(self, child: ServerProcess) -> None:
        with affinity(self.server_cores):  # every server on the same core(s)
            child.start()
        self.stack.push_async_callback(child.stop)

    async def start_vllm(self) -> Backend:
        """The running vLLM of ``--vllm-url``, or the tiny one started here (not yet ready)."""
        args = self.args
        if args.vllm_url:
            url = args.vllm_url.rstrip("/")
            served = await served_model_of(url)
            return Backend(url, served, None, f"vLLM: {served} at {url} (already running)")
        model = await tiny_llama(args.data_dir)
        url = f"http://127.0.0.1:{free_port()}"
        cores = None if args.vllm_cores == "none" else parse_cores(args.vllm_cores)
        launch = VllmLaunch(cpu_cores=args.vllm_cores if cores else None)
        process = VllmProcess(
            model=model,
            served_model=TINY_MODEL_NAME,
            server=VllmServer(url=url, launch=launch),
            data_dir=args.data_dir,
            log_name="exact-hit",
        )
        say(f"starting vLLM ({TINY_MODEL_NAME}) at {url}; log {process.log_path}")
        with affinity(cores):  # every vLLM process inherits the pinning
            process.start()
        self.stack.push_async_callback(process.stop)
        pin = f", pinned to core(s) {args.vllm_cores}" if cores else ""
        note = f"vLLM: {TINY_MODEL_NAME} at {url} (started here{pin})"
        return Backend(url, TINY_MODEL_NAME, model, note, process)

    async def start_gateway(self, vllm: Backend, name: str = "gateway") -> Target:
        """The gateway with tenancy off (``gateway``) or on (``tenancy``)."""
        port = free_port()
        config = self.tmp / f"{name}.toml"
        data_dir = self.tmp / f"{name}-data"
        config.write_text(
            gateway_toml(
                data_dir=data_dir,
                port=port,
                vllm_url=vllm.url,
                served=vllm.served,
                model=vllm.model_path,
                embeddings=True,
                extra=tenancy_toml(name == "tenancy"),
            )
        )
        load_config(config)  # fail here, not in the child, on a bad config
        # every server on the same core(s); MiniLM's graph is exported once (GatewayProcess)
        gateway = GatewayProcess(
            config, port, GATEWAY_ENV, cores=self.server_cores, log=self.tmp / f"{name}.log"
        )
        self.stack.push_async_callback(stop_gateway, gateway)
        await gateway_ready(gateway, 300.0)
        say(f"{name} gateway ready at {gateway.url}")
        target = Target(name, gateway.url, self.client(), gateway.pid, "cf-aig-cache-status", "HIT")
        await prime(target)
        if await not_hits(target) < 1:  # the priming miss: the counter is the one to watch
            raise RuntimeError(f"{name}: its embeddings miss did not count in {NOT_HITS[0]}")
        return target

    async def start_bare(self, gateway: Target) -> Target:
        """The bare app, sending back the bytes of the gateway's hits."""
        replies = self.tmp / "replies.json"
        replies.write_bytes(msgspec.json.encode(await canned_replies(gateway)))
        port = free_port()
        argv = [sys.executable, ENTRY_SCRIPT, "--serve-bare", str(port), "--replies", str(replies)]
        url = f"http://127.0.0.1:{port}"
        child = self.child("bare app", argv, url, REPO, PYTHONPATH=str(REPO))
        await child.wait_ready(120.0)
        return Target("bare", url, self.client(), child.pid, None)

    def start_litellm(self, vllm: Backend) -> tuple[ServerProcess, str]:
        """LiteLLM's proxy from its own venv, 1 uvicorn worker (its default); not yet ready."""
        config = self.tmp / "litellm.yaml"
        config.write_bytes(litellm_config(vllm.url, vllm.served))
        port = free_port()
        argv = [str(self.args.litellm_venv / "bin" / "litellm"), "--config", str(config)]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        # no cost-map download (offline); log level error: no access log, as for the others
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        url = f"http://127.0.0.1:{port}"
        return self.child("LiteLLM proxy", argv, url, self.tmp, **env), url

    async def litellm_target(self, child: ServerProcess, url: str) -> Target:
        waited = await child.wait_ready(600.0, "/health/liveliness")
        say(f"LiteLLM proxy ready at {url} after {waited:.0f} s")
        target = Target(
            "litellm", url, self.client(), child.pid, "x-litellm-cache-key", kinds=CHAT_KINDS
        )
        await prime(target)
        return target


def start_profiler(pid: int, out: Path, tmp: Path) -> subprocess.Popen[bytes]:
    """py-spy (from the project venv) sampling the gateway, collapsed stacks into ``out``."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.parent.mkdir(parents=True, exist_ok=True)
    log = (tmp / "py-spy.log").open("ab")
    argv = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--output", str(out)]
    argv += ["--rate", "250", "--nonblocking"]
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent_hook(signal.SIGKILL),
    )


def stop_profiler(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
