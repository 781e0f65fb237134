"""``/v1/classify`` on a vLLM classification model: a real vLLM (started by the launcher from a
``task = "classify"`` backend) serving a tiny random-weight ``LlamaForSequenceClassification``,
and the real ``semcache serve`` process in front (``--no-launch``: the test's launcher owns
vLLM) with the per-item semantic cache on.

Backend calls are counted on vLLM's own /metrics (``vllm:request_success_total`` counts one
per classified text). The last test kills vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.config import EmbeddedClassifierConfig, VllmBackendConfig, VllmServer
from backends.launch.launcher import Launcher
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import metric_value
from harness.ports import free_port
from harness.tiny_classifier import LABELS, tiny_classifier
from harness.vllm_process import single_process_launch
from server.config import GatewayConfig, ModelEntry, ServerSettings
from tests.server.test_semantic_http import near_duplicate, questions
from tests.support.configs import CLASSIFICATION_SEMANTIC, write_policy

pytestmark = pytest.mark.slow

MODEL = "tiny-cls"
ALIAS = "@cf/test/tiny-cls"
SERVED = "tiny-classifier"
AUTH = {"authorization": "Bearer tenant-a"}
MAX_MODEL_LEN = 256


POLICY = 'version = 1\n[tiers.disk]\ndir = "cache/exact"\n' + CLASSIFICATION_SEMANTIC


def vllm_backend(model_dir: Path, url: str) -> VllmBackendConfig:
    return VllmBackendConfig(
        name="vcls",
        served_model=SERVED,
        task="classify",
        model_path=str(model_dir),
        health_interval_s=1.0,
        servers=[
            VllmServer(
                url=url,
                launch=single_process_launch(kv_cache_gib=1.0, max_model_len=MAX_MODEL_LEN),
            )
        ],
    )


def classify_config(backend: VllmBackendConfig, tmp: Path) -> GatewayConfig:
    """The vLLM classifier and the embedded sentiment model, data under ``tmp``."""
    return GatewayConfig(
        data_dir=str(tmp),
        policy=str(write_policy(tmp, POLICY)),
        server=ServerSettings(max_body_bytes=1024 * 1024),
        models=[
            ModelEntry(id=MODEL, backend="vcls", task="classification", aliases=[ALIAS]),
            ModelEntry(id="sentiment", backend="sentiment", task="classification"),
        ],
        backends=[backend, EmbeddedClassifierConfig(name="sentiment")],
    )


class Setup:
    def __init__(
        self, launcher: Launcher, backend: VllmBackendConfig, gateway: GatewayProcess
    ) -> None:
        """``gateway``: not yet started; :meth:`close` stops it."""
        self.launcher = launcher
        self.vllm_url = backend.servers[0].url
        self.gateway = gateway
        self.http = httpx.Client(base_url=self.gateway.url, timeout=60)
        self.direct = httpx.Client(base_url=self.vllm_url, timeout=60)

    def classify(self, texts: Any, model: str = MODEL) -> httpx.Response:
        return self.http.post("/v1/classify", json={"model": model, "input": texts}, headers=AUTH)

    def vllm(self, texts: list[str]) -> dict[str, Any]:
        r = self.direct.post("/classify", json={"model": SERVED, "input": texts})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    async def vllm_calls(self) -> float:
        """Texts vLLM has classified so far."""
        return await metric_value(self.vllm_url, "vllm:request_success_total")

    def close(self) -> None:
        self.http.close()
        self.direct.close()
        self.gateway.stop()


@pytest.fixture(scope="module")
async def setup(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Setup]:
    import asyncio

    model_dir = await asyncio.to_thread(tiny_classifier, data_dir / "models")
    backend = vllm_backend(model_dir, f"http://127.0.0.1:{free_port()}")
    tmp = tmp_path_factory.mktemp("vcls")
    config = write_config_toml(classify_config(backend, tmp), tmp / "gateway.toml")
    async with Launcher([backend], data_dir, progress=lambda _m: None) as launcher:
        s = Setup(launcher, backend, GatewayProcess(config))
        try:
            await asyncio.to_thread(s.gateway.start)
            yield s
        finally:
            await asyncio.to_thread(s.close)


@pytest.fixture
def s(setup: Setup) -> Iterator[Setup]:
    yield setup


def probs_of(body: dict[str, Any]) -> list[list[float]]:
    return [d["probs"] for d in body["data"]]


def assert_same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Labels and probabilities per text, in order (bf16 batches may differ in the 3rd digit)."""
    assert [d["index"] for d in got["data"]] == list(range(len(want["data"])))
    for g, w in zip(got["data"], want["data"], strict=True):
        assert g["num_classes"] == w["num_classes"] == len(LABELS)
        assert g["probs"] == pytest.approx(w["probs"], abs=0.02)
        if abs(w["probs"][0] - w["probs"][1]) > 0.05:
            assert g["label"] == w["label"]
        assert g["label"] == LABELS[max(range(len(LABELS)), key=g["probs"].__getitem__)]


async def test_launcher_starts_vllm_as_a_pooling_classifier(s: Setup) -> None:
    (process,) = s.launcher.processes
    assert process.command[process.command.index("--runner") + 1] == "pooling"
    models = s.direct.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [SERVED]
    card = s.http.get(f"/v1/models/{MODEL}").json()
    assert card["task"] == "classification" and card["revision"]


async def test_classify_returns_vllms_labels_and_probs_in_order(s: Setup) -> None:
    texts = ["The cat sees a book today.", "What a wonderful day!", *questions(4)]
    want = s.vllm(texts)
    assert {d["label"] for d in want["data"]} == set(LABELS)  # the tiny model uses both
    before = await s.vllm_calls()
    r = s.classify(texts)
    assert r.status_code == 200, r.text
    got = r.json()
    assert await s.vllm_calls() - before == len(texts)
    assert_same_answer(got, want)
    assert got["model"] == MODEL
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]  # same tokenizer

    one = s.classify(texts[1])  # a plain string, through the alias
    assert one.status_code == 200
    assert len(one.json()["data"]) == 1

    wai = s.http.post(
        f"/client/v4/accounts/acct/ai/run/{ALIAS}", json={"text": texts[0]}, headers=AUTH
    )
    assert wai.status_code == 200, wai.text
    result = wai.json()["result"]
    assert [row["label"] for row in result] == sorted(
        LABELS, key=lambda label: -want["data"][0]["probs"][LABELS.index(label)]
    )


async def test_near_duplicates_are_semantic_hits_without_a_vllm_call(s: Setup) -> None:
    texts = questions(3, skip=10)
    first = s.classify(texts)
    assert first.status_code == 200, first.text
    assert "detail=semantic" not in first.headers["cache-status"]
    before = await s.vllm_calls()
    again = s.classify([near_duplicate(t) for t in texts])
    assert again.status_code == 200, again.text
    assert await s.vllm_calls() == before  # nothing reached vLLM
    h = again.headers
    assert h["x-semcache-semantic"] == "hit" and h["x-semcache-semantic-items"] == "3/3"
    assert "hit" in h["cache-status"] and "detail=semantic" in h["cache-status"]
    assert probs_of(again.json()) == probs_of(first.json())

    # Half new: only the new texts go to vLLM, the answer keeps the request's order.
    new = questions(2, skip=20)
    mixed = [new[0], near_duplicate(texts[1]), new[1]]
    before = await s.vllm_calls()
    part = s.classify(mixed)
    assert part.status_code == 200, part.text
    assert await s.vllm_calls() - before == 2
    assert part.headers["x-semcache-semantic-items"] == "1/3"
    got, want = part.json(), s.vllm(mixed)
    assert probs_of(got)[1] == probs_of(first.json())[1]  # the cached answer, in its place
    for key in (got, want):
        key["data"] = [key["data"][0], {**key["data"][2], "index": 1}]
    assert_same_answer(got, want)  # vLLM's own for the new texts


async def test_models_do_not_share_hits(s: Setup) -> None:
    texts = questions(2, skip=30)
    embedded = s.classify(texts, model="sentiment")
    assert embedded.status_code == 200, embedded.text
    before = await s.vllm_calls()
    r = s.classify([near_duplicate(t) for t in texts])
    assert r.status_code == 200, r.text
    assert await s.vllm_calls() - before == 2  # the embedded model's entries are not ours
    assert "detail=semantic" not in r.headers["cache-status"]
    assert_same_answer(r.json(), s.vllm([near_duplicate(t) for t in texts]))

    # ...nor the other way round: the vLLM model's entries are not the embedded model's.
    (fresh,) = questions(1, skip=35)
    assert s.classify([fresh]).status_code == 200
    other = s.classify([near_duplicate(fresh)], model="sentiment")
    assert other.status_code == 200, other.text
    assert "detail=semantic" not in other.headers["cache-status"]
    again = s.classify([near_duplicate(fresh)])  # the vLLM model's own entry still serves
    assert again.headers["x-semcache-semantic"] == "hit"


def assert_openai_error(r: httpx.Response, status: int | tuple[int, ...]) -> dict[str, Any]:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


async def test_bad_input_is_an_openai_400(s: Setup) -> None:
    before = await s.vllm_calls()
    assert_openai_error(s.classify([]), 400)
    err = assert_openai_error(s.classify(["fine", 3]), 400)
    assert err["param"] == "input[1]"
    assert_openai_error(s.classify([""]), 400)
    assert await s.vllm_calls() == before

    # Too long for the model: vLLM refuses it, its message comes back as an OpenAI 400.
    long = " ".join(["word"] * (MAX_MODEL_LEN * 2))
    err = assert_openai_error(s.classify([long]), 400)
    assert err["type"] == "invalid_request_error"
    assert "maximum context length" in err["message"]
    assert_openai_error(s.classify([long]), 400)  # refused again: nothing was cached


async def test_killed_vllm_is_a_502_or_503_and_nothing_is_cached(s: Setup) -> None:
    cached = questions(1, skip=40)
    assert s.classify(cached).status_code == 200
    (process,) = s.launcher.processes
    process.kill()
    texts = questions(2, skip=50)
    for _ in range(2):  # the second try must not find a stored answer either
        err = assert_openai_error(s.classify(texts), (502, 503))
        assert err["code"] in ("backend_error", "backend_unavailable")
    # One cached item and one new: the request fails whole, no partial answer is stored.
    mixed = [near_duplicate(cached[0]), texts[0]]
    assert_openai_error(s.classify(mixed), (502, 503))
    assert_openai_error(s.classify([near_duplicate(texts[1])]), (502, 503))
    # What was cached before the crash is still served.
    deadline = time.monotonic() + 5
    hit = s.classify([near_duplicate(cached[0])])
    while hit.status_code != 200 and time.monotonic() < deadline:
        hit = s.classify([near_duplicate(cached[0])])
    assert hit.status_code == 200 and hit.headers["x-semcache-semantic"] == "hit"
