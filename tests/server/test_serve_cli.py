"""`semcache serve` end to end: the embedded default (real SmolLM2 on a vLLM prefill/decode
pair), as a user starts it, then Ctrl-C.

One process serves the module: it answers the openai SDK (SmolLM2 knows Paris), its launched
servers hand a long prompt's KV over NIXL with every thread on its configured core, and
Ctrl-C (the last test) stops it and every vLLM process it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest

from backends.config import VllmBackendConfig
from backends.launch import cpu_pinning
from harness.gateway import GatewayProcess
from harness.metrics import metric_value, parse_metric
from server.config import GatewayConfig
from tests.support.affinity import thread_affinities
from tests.support.configs import write_default_config
from tests.support.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.slow

TWO_CORES = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
MODEL = "SmolLM2-135M-Instruct"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Served:
    gateway: GatewayProcess
    config: GatewayConfig

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.gateway.proc is not None
        return self.gateway.proc

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def lines(self) -> list[str]:
        return self.gateway.lines

    def log(self, last: int = 40) -> str:
        return self.gateway.log_tail(last)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[Served]:
    path, config = write_default_config(tmp_path_factory.mktemp("serve"), data_dir)
    gateway = GatewayProcess(path, launch=True)
    try:
        yield Served(gateway.start(600), config)
    finally:
        gateway.stop(60)  # the Ctrl-C test did not run, or failed


def test_serve_default_answers_the_openai_sdk(served: Served) -> None:
    out = "".join(served.lines)
    assert "starting vLLM" in out
    assert "waiting for vLLM" in out or "vLLM ready" in out

    # ready once KV placement has its tokenizer (the shipped servers publish KV events)
    def ready() -> bool:  # a probe may time out while the gateway loads the tokenizer
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{served.url}/ready").status_code == 200
        return False

    wait_until(ready, timeout_s=120)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(  # no-cache: to vLLM though the data dir persists
        model=MODEL,
        messages=question,
        temperature=0,
        max_tokens=30,
        extra_headers={"cache-control": "no-cache"},
    )
    assert "Paris" in (answer.choices[0].message.content or "")
    stream = client.chat.completions.create(
        model="@cf/huggingface/smollm2-135m-instruct",
        messages=question,
        temperature=0,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content
    assert chunks[-1].usage is not None
    emb = client.embeddings.create(model="all-MiniLM-L6-v2", input=["Paris", "France"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 384
    assert httpx.get(f"{served.url}/ready").status_code == 200
    # KV placement decided the chat that reached vLLM (the stream may be a cache hit) from the
    # servers' events, and the short prompt's uncached tokens kept it on the decode server
    page = httpx.get(f"{served.url}/metrics").text
    decided = "semcache_kv_placement_decisions_total"
    seen = [line for line in page.splitlines() if line.startswith(("semcache_kv", "semcache_pd"))]
    assert parse_metric(page, decided, {"role": "decode"}) >= 1, "\n".join(seen)
    assert parse_metric(page, decided, {"reason": "fallback"}) == 0, "\n".join(seen)
    assert parse_metric(page, "semcache_pd_prefill_skipped_total") >= 1
    assert parse_metric(page, "semcache_pd_hops_total", {"hop": "prefill"}) == 0


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_serve_default_calls_tools_and_answers_the_anthropic_sdk(served: Served) -> None:
    """SmolLM2 is launched with the xlam parser and a template that renders its tools."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("auto", "required"):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=question,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=60,
        )
        calls = answer.choices[0].message.tool_calls or []
        if choice == "required":  # one call or more, each of the tool offered
            assert calls and {c.function.name for c in calls} == {"get_weather"}  # type: ignore[union-attr]
    claude = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    message = claude.messages.create(
        model=MODEL,
        max_tokens=30,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in message.content[0].text  # type: ignore[union-attr]


@TWO_CORES
async def test_every_thread_of_the_launched_pair_runs_on_its_configured_core(
    served: Served,
) -> None:
    (backend,) = [b for b in served.config.backends if isinstance(b, VllmBackendConfig)]
    servers = {s.role: s for s in backend.servers}
    assert {role: s.launch.cpu_cores for role, s in servers.items() if s.launch} == {
        "prefill": "0",
        "decode": "1",
    }  # each on a core of its own
    # One hand-off first (a prompt over the prefill threshold): the NIXL handshake starts
    # threads of its own.
    prompt = f"{uuid.uuid4()} " + "A bird visits the old tree every day. " * 40
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    await client.close()

    async def pulled() -> bool:  # the decode server's stats follow the answer
        hits = await metric_value(servers["decode"].url, "vllm:external_prefix_cache_hits_total")
        return hits > 0

    await wait_until_async(pulled, timeout_s=10)  # it pulled the prompt's KV over NIXL

    launched = {
        port: child
        for child in psutil.Process(served.proc.pid).children()
        if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline())
        for port in [child.cmdline()[child.cmdline().index("--port") + 1]]
    }
    for role, server in servers.items():
        port = server.url.rsplit(":", 1)[1]
        threads = thread_affinities(launched[port].pid)
        names = " ".join(threads)
        assert "VLLM::Worker" in names and "VLLM::EngineCore" in names
        assert server.launch is not None
        cores = cpu_pinning.parse_cores(server.launch.cpu_cores or "")
        strays = {t: sorted(c) for t, c in threads.items() if not c <= cores}
        assert not strays, f"{role} threads off cores {sorted(cores)}: {strays}"


def test_ctrl_c_stops_the_gateway_and_every_vllm_process(served: Served) -> None:
    proc = served.proc
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert family, "vLLM runs as a child of semcache serve"
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, served.log(30)

    # vLLM's multiprocessing resource trackers exit with their server but end as zombies of
    # init, which reaps them a moment later: dead, not left behind. Nothing may still run.
    def ctrl_c_left_nothing_behind() -> bool:
        return not [pid for pid in family if _running(pid)]

    wait_until(ctrl_c_left_nothing_behind, timeout_s=10)
    for server in served.config.backends[0].servers:  # type: ignore[union-attr]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")
