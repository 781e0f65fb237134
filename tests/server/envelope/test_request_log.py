"""The request log and the requests metric, on the app ``semcache serve`` builds: one line
per request with its cache outcome, tokens and error code; batch items too; the file on
disk holds what ``GET /admin/logs`` answered."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig
from server.identity.auth import AuthSettings, TokenEntry
from tests.support.waiting import wait_until

ACME = {"authorization": "Bearer tok-acme"}
OPS = {"authorization": "Bearer tok-ops"}
CHAT = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def build(tmp_path: Path, embedder: LocalEmbeddingBackend, policy: Path | None = None) -> Any:
    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.embedding["minilm"] = embedder
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    reg.add(ModelInfo("embed-model", "embeddings", ("@cf/test/embed",), "t", "minilm", "r", "n"))
    tokens = [
        TokenEntry(token="tok-acme", tenant="acme"),
        TokenEntry(token="tok-ops", tenant="ops", roles=["admin"], name="ops"),
    ]
    config = GatewayConfig(
        data_dir=str(tmp_path),
        auth=AuthSettings(tokens=tokens),
        policy=str(policy) if policy is not None else None,
    )
    return create_app(config, registry=reg)


def logs(client: TestClient[Any], **query: Any) -> list[dict[str, Any]]:
    r = client.get("/admin/logs", params=query, headers=OPS)
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def test_each_request_is_one_line(tmp_path: Path, embedder: LocalEmbeddingBackend) -> None:
    with TestClient(build(tmp_path, embedder)) as client:
        miss = client.post("/v1/chat/completions", json=CHAT, headers=ACME)
        hit = client.post("/v1/chat/completions", json=CHAT, headers=ACME)
        bad = client.post("/v1/chat/completions", json={"model": "chat-model"}, headers=ACME)
        assert (miss.status_code, hit.status_code, bad.status_code) == (200, 200, 400)
        lines = logs(client, tenant="acme")
        assert [line["status"] for line in lines] == [400, 200, 200]  # newest first
        error, exact, first = lines
        assert first["request_id"] == miss.headers["x-request-id"]
        assert (first["cache"], first["prompt_tokens"], first["completion_tokens"]) == (
            "miss",
            3,
            1,
        )
        assert (exact["cache"], exact["prompt_tokens"], exact["saved_tokens"]) == ("exact", 0, 4)
        assert error["error_code"] == "missing_required_parameter" and error["cache"] == "none"
        assert all(line["model"] in ("chat-model", None) for line in lines)
        assert first["latency_ms"] >= first["ttft_ms"] > 0 and first["completed"] is True
        assert logs(client, status=400) == [error]
        assert logs(client, tenant="acme", limit=1) == [error]
        assert logs(client, since=first["time"] + 3600) == []
        refused = client.get("/admin/logs", headers=ACME)
        assert refused.status_code == 403
        metrics = client.get("/metrics").text
        labels = 'model="chat-model",route="/v1/chat/completions",status="200"'
        assert f"semcache_requests_total{{{labels}}} 2.0" in metrics
        assert "acme" not in metrics  # no tenant labels unless configured
    written = [
        json.loads(x) for x in (tmp_path / "logs" / "requests.jsonl").read_text().splitlines()
    ]
    assert [w["request_id"] for w in written if w["tenant"] == "acme"] == [
        line["request_id"] for line in reversed(lines)
    ]
    assert "tok-acme" not in (tmp_path / "logs" / "requests.jsonl").read_text()


def test_batch_items_are_logged(tmp_path: Path, embedder: LocalEmbeddingBackend) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings"}
    line["body"] = {"model": "embed-model", "input": "hello"}  # type: ignore[assignment]
    files = {"file": ("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n"))}
    with TestClient(build(tmp_path, embedder)) as client:
        up = client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=ACME)
        body = {"input_file_id": up.json()["id"], "endpoint": "/v1/embeddings"}
        batch = client.post("/v1/batches", json={**body, "completion_window": "24h"}, headers=ACME)
        assert batch.status_code == 200, batch.text
        wait_until(
            lambda: (
                logs(client, tenant="acme", status=200)
                and any(x["route"] == "batch" for x in logs(client, tenant="acme"))
            ),
            timeout_s=30,
        )
        (item,) = [x for x in logs(client, tenant="acme") if x["route"] == "batch"]
        assert item["model"] == "embed-model" and item["prompt_tokens"] > 0


def test_bodies_are_logged_only_where_the_policy_says(
    tmp_path: Path, embedder: LocalEmbeddingBackend
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("version = 1\n[routes.chat]\nlog_bodies = true\n")
    with TestClient(build(tmp_path, embedder, policy)) as client:
        chat = client.post("/v1/chat/completions", json=CHAT, headers=ACME)
        embed = {"model": "embed-model", "input": "quiet"}
        assert client.post("/v1/embeddings", json=embed, headers=ACME).status_code == 200
        lines = logs(client, tenant="acme")
        assert lines[0]["route"] == "/v1/embeddings" and "request_body" not in lines[0]
        logged = lines[1]
        assert json.loads(logged["request_body"]) == CHAT
        assert logged["response_body"] == chat.text and logged["bodies_truncated"] is False
