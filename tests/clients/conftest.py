"""One ``semcache serve`` on the embedded default (SmolLM2 on a vLLM prefill/decode pair,
MiniLM embeddings, the sentiment classifier) for every client test.

Session-scoped, and the client tests are one module: under ``make test``'s ``--dist
loadscope`` they run on one worker, so one gateway (and one vLLM pair) serves them all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.gateway import GatewayProcess
from harness.metrics import parse_metric
from tests.support.configs import write_default_config
from tests.support.waiting import wait_until

# Before any client is imported: litellm fetches its price map from GitHub at import unless
# told to read the copy it ships; the agents SDK and LangChain export traces unless told not to.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

MODEL = "SmolLM2-135M-Instruct"
EMBEDDINGS = "all-MiniLM-L6-v2"


class Gateway:
    def __init__(self, url: str, process: GatewayProcess | None = None) -> None:
        self.process = process
        self.url = url

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One series of /metrics (summed over the labels not given)."""
        page = httpx.get(f"{self.url}/metrics", timeout=10).text
        return parse_metric(page, name, labels or {})

    def exact_hits(self) -> float:
        return self.metric("semcache_exact_hits_total")

    def log(self, last: int = 60) -> str:
        return self.process.log_tail(last) if self.process else ""


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[Gateway]:
    """``SEMCACHE_TEST_GATEWAY_URL``: a ``semcache serve`` of the default already running
    (developer speed-up)."""
    if url := os.environ.get("SEMCACHE_TEST_GATEWAY_URL"):
        yield Gateway(url.rstrip("/"))
        return
    path, _ = write_default_config(tmp_path_factory.mktemp("clients"), data_dir)
    process = GatewayProcess(path, launch=True)
    try:
        process.start(600)

        def ready() -> bool:  # every backend has a healthy server, KV placement its tokenizer
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{process.url}/ready", timeout=5).status_code == 200
            return False

        wait_until(ready, timeout_s=180, interval_s=0.5)
        yield Gateway(process.url, process)
    finally:
        process.stop(60)
