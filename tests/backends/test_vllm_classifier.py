"""The vLLM classifier backend against local HTTP servers standing in for vLLM's ``/classify``
(its answer shapes, refusals and failures), plus its config and launch flags."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from backends.config import VllmBackendConfig, VllmLaunch, VllmServer
from backends.interfaces import BackendError, UpstreamRejected
from backends.launch.command import build_command
from backends.local.classifier import label_names
from backends.vllm.classifier import VllmClassifier, labels_from_config
from backends.vllm.client import VllmClient
from foundation.request import RequestContext
from harness.fake_vllm import FakeServer
from server.config import ConfigError, parse_config

Answer = Callable[[list[str]], Awaitable[web.Response]]


def classify_answer(probs: list[list[float]], labels: list[str | None]) -> dict[str, Any]:
    data = [
        {"index": i, "label": label, "probs": p, "num_classes": len(p)}
        for i, (p, label) in enumerate(zip(probs, labels, strict=True))
    ]
    return {"id": "classify-1", "object": "list", "model": "m", "data": data, "usage": {}}


class Vllm:
    """A fake vLLM whose ``/classify`` answer the test sets; records the bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer: Callable[[list[str]], web.Response] = self.two_labels
        self.server = FakeServer(self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read()) if request.can_read_body else {}
        if request.path == "/health":
            return web.Response(text="")
        self.bodies.append({"path": request.path, **body})
        if request.path == "/tokenize":
            return web.json_response({"count": len(body["prompt"].split()) + 1})
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return self.answer(texts)

    @staticmethod
    def two_labels(texts: list[str]) -> web.Response:
        """POSITIVE when the text says "good" (index 1), else NEGATIVE."""
        probs = [[0.1, 0.9] if "good" in t else [0.8, 0.2] for t in texts]
        labels: list[str | None] = ["POSITIVE" if p[1] > p[0] else "NEGATIVE" for p in probs]
        return web.json_response(classify_answer(probs, labels))


@pytest.fixture
async def vllm() -> AsyncIterator[Vllm]:
    fake = Vllm()
    await fake.server.start()
    try:
        yield fake
    finally:
        await fake.server.stop()


def model_dir(tmp: Path, id2label: dict[str, str] | None) -> Path:
    config: dict[str, Any] = {"architectures": ["LlamaForSequenceClassification"]}
    if id2label is not None:
        config["id2label"] = id2label
    (tmp / "config.json").write_bytes(orjson.dumps(config))
    return tmp


def classifier(url: str, folder: Path | None = None) -> VllmClassifier:
    config = VllmBackendConfig(
        name="vcls", served_model="m", task="classify", servers=[VllmServer(url=url)]
    )
    return VllmClassifier(VllmClient(config), revision="rev-1", model_dir=folder)


CTX = RequestContext(request_id="r1", tenant="t")


async def test_labels_and_scores_in_the_embedded_classifier_form(
    vllm: Vllm, tmp_path: Path
) -> None:
    c = classifier(vllm.server.url, model_dir(tmp_path, {"0": "NEGATIVE", "1": "POSITIVE"}))
    try:
        assert c.labels == ["NEGATIVE", "POSITIVE"] and c.version == "rev-1"
        scored = await c.classify(["a good day", "a bad day"], CTX)
        assert scored == [
            [("POSITIVE", 0.9), ("NEGATIVE", 0.1)],
            [("NEGATIVE", 0.8), ("POSITIVE", 0.2)],
        ]
        (body,) = vllm.bodies
        assert body["path"] == "/classify" and body["model"] == "m"
        assert body["input"] == ["a good day", "a bad day"]
    finally:
        await c.client.aclose()


async def test_answers_out_of_index_order_are_put_back_in_order(vllm: Vllm) -> None:
    def reversed_order(texts: list[str]) -> web.Response:
        answer = classify_answer([[0.3, 0.7], [0.6, 0.4]], ["B", "A"])
        answer["data"].reverse()
        return web.json_response(answer)

    vllm.answer = reversed_order
    c = classifier(vllm.server.url)
    try:
        scored = await c.classify(["x", "y"], CTX)
        # Without the model folder the labels are transformers' defaults until vLLM names them.
        assert scored == [[("B", 0.7), ("A", 0.3)], [("A", 0.6), ("B", 0.4)]]
        assert c.labels == ["A", "B"]
    finally:
        await c.client.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        b"not json",
        b'{"data": "nope"}',
        orjson.dumps(classify_answer([[0.5, 0.5]], ["A"])),  # one row for two texts
        orjson.dumps(classify_answer([[0.5, 0.5], [0.2, 0.3, 0.5]], ["A", "C"])),
        orjson.dumps(classify_answer([[0.1, 0.9], [0.9, 0.1]], ["NEGATIVE", "NEGATIVE"])),
    ],
    ids=["not-json", "no-rows", "missing-row", "ragged", "label-not-the-config's"],
)
async def test_a_malformed_answer_is_a_broken_backend(
    vllm: Vllm, tmp_path: Path, answer: bytes
) -> None:
    vllm.answer = lambda texts: web.Response(body=answer, content_type="application/json")
    c = classifier(vllm.server.url, model_dir(tmp_path, {"0": "NEGATIVE", "1": "POSITIVE"}))
    try:
        with pytest.raises(BackendError) as caught:
            await c.classify(["x", "y"], CTX)
        assert caught.value.kind == "broken"
    finally:
        await c.client.aclose()


async def test_a_refusal_carries_vllms_message(vllm: Vllm) -> None:
    error = {"error": {"message": "too long", "type": "BadRequestError", "code": 400}}
    vllm.answer = lambda texts: web.json_response(error, status=400)
    c = classifier(vllm.server.url)
    try:
        with pytest.raises(UpstreamRejected) as caught:
            await c.classify(["x"], CTX)
        assert caught.value.status == 400 and caught.value.message == "too long"
    finally:
        await c.client.aclose()


async def test_a_missing_route_or_model_is_a_broken_backend_not_a_client_error(
    vllm: Vllm,
) -> None:
    error = {"error": {"message": "The model `m` does not exist.", "code": 404}}
    vllm.answer = lambda texts: web.json_response(error, status=404)
    c = classifier(vllm.server.url)
    try:
        with pytest.raises(BackendError) as caught:
            await c.classify(["x"], CTX)
        assert caught.value.kind == "broken" and "does not exist" in caught.value.message
    finally:
        await c.client.aclose()


async def test_a_server_error_or_a_dead_server_is_a_backend_error(vllm: Vllm) -> None:
    vllm.answer = lambda texts: web.Response(status=500, text="boom")
    c = classifier(vllm.server.url)
    try:
        with pytest.raises(BackendError):
            await c.classify(["x"], CTX)
        await vllm.server.stop()
        with pytest.raises(BackendError) as caught:
            await c.classify(["x"], CTX)
        assert caught.value.kind in ("unreachable", "unavailable")
    finally:
        await c.client.aclose()


async def test_tokens_from_the_model_tokenizer_or_vllms_tokenize(
    vllm: Vllm, data_dir: Path
) -> None:
    from harness.tiny_classifier import tiny_classifier

    folder = tiny_classifier(data_dir / "models")
    local = classifier(vllm.server.url, folder)
    remote = classifier(vllm.server.url)
    try:
        await local.start()
        assert local.labels == ["NEGATIVE", "POSITIVE"]
        counts = await local.count_tokens(["the cat sees a book", "hi"])
        assert all(n > 1 for n in counts)  # BOS included
        assert not vllm.bodies  # counted without vLLM
        assert await remote.count_tokens(["one two three"]) == [4]
        assert vllm.bodies[-1]["path"] == "/tokenize"
    finally:
        await local.client.aclose()
        await remote.client.aclose()


def test_labels_from_config(tmp_path: Path) -> None:
    assert labels_from_config(model_dir(tmp_path, {"1": "b", "0": "a"})) == ["a", "b"]
    assert labels_from_config(model_dir(tmp_path, {"0": "a", "2": "c"})) == []  # a gap
    assert labels_from_config(model_dir(tmp_path, None)) == []
    assert labels_from_config(tmp_path / "absent") == []


def test_a_classify_backend_is_launched_as_a_pooling_model() -> None:
    backend = VllmBackendConfig(
        name="vcls",
        served_model="m",
        task="classify",
        servers=[VllmServer(url="http://127.0.0.1:8200", launch=VllmLaunch())],
    )
    cmd, _ = build_command(
        model=Path("/m"), served_model="m", server=backend.servers[0], device="cpu", python="/py"
    )
    assert cmd[cmd.index("--runner") + 1] == "pooling"
    explicit = VllmBackendConfig(
        name="vcls",
        served_model="m",
        task="classify",
        servers=[
            VllmServer(
                url="http://127.0.0.1:8200",
                launch=VllmLaunch(extra_args=["--runner=pooling", "--convert", "classify"]),
            )
        ],
    )
    assert explicit.servers[0].launch is not None
    assert explicit.servers[0].launch.extra_args == ["--runner=pooling", "--convert", "classify"]
    generate = VllmBackendConfig(
        name="gen",
        served_model="m",
        servers=[VllmServer(url="http://127.0.0.1:8200", launch=VllmLaunch())],
    )
    cmd, _ = build_command(
        model=Path("/m"), served_model="m", server=generate.servers[0], device="cpu", python="/py"
    )
    assert "--runner" not in cmd


def gateway_toml(model_task: str, backend_task: str) -> dict[str, Any]:
    return {
        "models": [{"id": "x", "backend": "v", "task": model_task}],
        "backends": [
            {
                "kind": "vllm",
                "name": "v",
                "served_model": "m",
                "task": backend_task,
                "servers": [{"url": "http://127.0.0.1:8200"}],
            }
        ],
    }


def test_config_pairs_classification_models_with_classify_backends() -> None:
    parse_config(gateway_toml("classification", "classify"))
    parse_config(gateway_toml("chat", "generate"))
    with pytest.raises(ConfigError, match='task = "classify"'):
        parse_config(gateway_toml("classification", "generate"))
    with pytest.raises(ConfigError, match="serves classification only"):
        parse_config(gateway_toml("chat", "classify"))
    doc = gateway_toml("classification", "classify")
    doc["backends"][0]["servers"] = [
        {"url": "http://127.0.0.1:8200", "role": "prefill"},
        {"url": "http://127.0.0.1:8201", "role": "decode"},
    ]
    with pytest.raises(ConfigError, match="no prefill/decode"):
        parse_config(doc)


def test_label_names_fill_in_unknown_labels() -> None:
    assert label_names(["A"], 3) == ["A", "LABEL_1", "LABEL_2"]
    assert label_names(["A", "B"], 2) == ["A", "B"]
