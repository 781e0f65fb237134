"""``/v1/rerank``, ``/v1/score``, ``/tokenize`` and ``/detokenize`` through ``semcache serve``:
the gateway launches a real vLLM serving a tiny random-weight cross-encoder (its pooling
runner) beside the session's tiny chat model, and caches scores per (query, document) pair.
What reached vLLM is read off its own counter (one finished request per scored pair).
Two API keys have content rules (the policy's ``[guard.tenants]``): the scoring routes'
queries and documents are redacted or blocked as prompts."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.config import VllmBackendConfig, VllmServer
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.ports import free_port
from harness.tiny_cross_encoder import SERVED, tiny_cross_encoder
from harness.vllm_process import TINY_MODEL_NAME, single_process_launch
from semcache.policy import DEFAULT_POLICY
from server.config import ModelEntry
from server.identity.auth import tenant_from
from tests.conftest import gateway_config
from tests.support.dlp_values import SENTENCES, card

pytestmark = pytest.mark.slow

RERANKER = "tiny-rerank"
AUTH = {"authorization": "Bearer tenant-a"}
REDACT = {"authorization": "Bearer dlp-redact"}
BLOCK = {"authorization": "Bearer dlp-block"}


def guarded_policy() -> str:
    """The shipped policy, and a content rule for each of the two DLP keys' tenants."""
    rules = "".join(
        f'\n[guard.tenants."{tenant_from(headers)}".dlp.prompt]\nCREDIT_CARD = "{action}"\n'
        for headers, action in ((REDACT, "redact"), (BLOCK, "block"))
    )
    return DEFAULT_POLICY.read_text() + rules


QUERY = "Where does the cat read a book?"
DOCS = [
    "The cat reads a book near the window.",
    "A dog follows the river at night.",
    "Our team builds a small house in Paris.",
    "She paints the old tree after lunch.",
]


class Setup:
    def __init__(self, gateway: GatewayProcess, vllm_url: str) -> None:
        self.gateway = gateway
        self.vllm_url = vllm_url
        self.http = httpx.Client(base_url=gateway.url, timeout=60, headers=AUTH)

    def scored(self) -> float:
        """Pairs vLLM has scored so far (one finished request each)."""
        page = httpx.get(f"{self.vllm_url}/metrics", timeout=10).text
        return parse_metric(page, "vllm:request_success_total")


@pytest.fixture(scope="module")
def s(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    model_dir = tiny_cross_encoder(data_dir / "models")
    url = f"http://127.0.0.1:{free_port()}"
    reranker = VllmBackendConfig(
        name="rerank",
        served_model=SERVED,
        task="classify",
        model_path=str(model_dir),
        servers=[VllmServer(url=url, launch=single_process_launch(max_model_len=256))],
    )
    tmp = tmp_path_factory.mktemp("scoring")
    (tmp / "policy.toml").write_text(guarded_policy())
    config = gateway_config(
        tmp / "data",
        tiny_vllm.url,
        data_dir / "models" / TINY_MODEL_NAME,
        embeddings=False,
        policy=str(tmp / "policy.toml"),
    )
    config.models.append(ModelEntry(id=RERANKER, backend="rerank", task="rerank"))
    config.backends.append(reranker)
    gateway = GatewayProcess(write_config_toml(config, tmp / "gateway.toml"), launch=True)
    gateway.start(timeout_s=600)
    try:
        yield Setup(gateway, url)
    finally:
        gateway.stop()


def rerank(s: Setup, docs: list[str], **extra: Any) -> httpx.Response:
    body = {"model": RERANKER, "query": QUERY, "documents": docs, **extra}
    return s.http.post("/v1/rerank", json=body)


def test_a_rerank_over_a_partly_seen_list_scores_only_the_new_pairs(s: Setup) -> None:
    direct = httpx.post(
        f"{s.vllm_url}/rerank", json={"model": SERVED, "query": QUERY, "documents": DOCS[:3]}
    ).json()
    before = s.scored()
    first = rerank(s, DOCS[:3])
    assert first.status_code == 200, first.text
    assert s.scored() - before == 3
    got = first.json()
    assert [r["index"] for r in got["results"]] == [r["index"] for r in direct["results"]]
    for mine, theirs in zip(got["results"], direct["results"], strict=True):
        assert mine["relevance_score"] == pytest.approx(theirs["relevance_score"], abs=1e-3)
        assert mine["document"] == {"text": DOCS[mine["index"]]}
    assert got["model"] == RERANKER and got["usage"]["total_tokens"] > 0

    before = s.scored()
    more = rerank(s, DOCS, top_n=2)  # one new document, and a cut
    assert more.status_code == 200, more.text
    assert s.scored() - before == 1  # only the new pair reached vLLM
    assert more.headers["x-semcache-pairs-cached"] == "3/4"
    assert more.headers["cf-aig-cache-status"] == "MISS"
    results = more.json()["results"]
    assert len(results) == 2
    scores = {r["index"]: r["relevance_score"] for r in got["results"]}
    for r in results:
        if r["index"] in scores:
            assert r["relevance_score"] == scores[r["index"]]  # served from the pair's entry

    before = s.scored()
    again = rerank(s, DOCS, top_n=2)
    assert again.headers["cf-aig-cache-status"] == "HIT"
    assert again.json()["results"] == results
    assert s.scored() == before
    other = httpx.post(
        f"{s.gateway.url}/v1/rerank",
        json={"model": RERANKER, "query": QUERY, "documents": DOCS[:1]},
        headers={"authorization": "Bearer tenant-b"},
    )
    assert other.status_code == 200
    assert s.scored() - before == 1  # another tenant's pairs are its own


def test_score_pairs_share_the_rerank_pairs(s: Setup) -> None:
    rerank(s, DOCS[:2])
    before = s.scored()
    r = s.http.post("/v1/score", json={"model": RERANKER, "queries": QUERY, "documents": DOCS[:2]})
    assert r.status_code == 200, r.text
    assert s.scored() == before  # both pairs were scored by the rerank
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and all(d["object"] == "score" for d in data)
    paired = s.http.post(
        "/v1/score",
        json={"model": RERANKER, "text_1": [QUERY, QUERY], "text_2": [DOCS[1], "A new text."]},
    )
    assert paired.status_code == 200, paired.text
    assert s.scored() - before == 1
    assert paired.json()["data"][0]["score"] == data[1]["score"]
    bad = s.http.post(
        "/v1/score", json={"model": RERANKER, "queries": [QUERY, QUERY], "documents": DOCS[:3]}
    )
    assert bad.status_code == 400 and bad.json()["error"]["message"]
    wrong = s.http.post("/v1/rerank", json={"model": "tiny-chat", "query": "q", "documents": ["d"]})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_task_mismatch"


def test_workers_ai_reranks_through_the_same_pairs(s: Setup) -> None:
    rerank(s, DOCS[:2])
    before = s.scored()
    run = f"/client/v4/accounts/acc/ai/run/{RERANKER}"
    contexts = [{"text": d} for d in [*DOCS[:2], "A brand new context."]]
    r = s.http.post(run, json={"query": QUERY, "contexts": contexts, "top_k": 2})
    assert r.status_code == 200, r.text
    assert s.scored() - before == 1  # the two documents a rerank scored are pairs already
    response = r.json()["result"]["response"]
    assert len(response) == 2 and response[0]["score"] >= response[1]["score"]
    assert {row["id"] for row in response} <= {0, 1, 2}


def test_tokenize_and_detokenize_are_cached_per_tenant(s: Setup) -> None:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hello there"}]}
    first = s.http.post("/tokenize", json=body)
    assert first.status_code == 200, first.text
    tokens = first.json()["tokens"]
    assert first.json()["count"] == len(tokens) > 0
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert s.http.post("/tokenize", json=body).headers["cf-aig-cache-status"] == "HIT"
    other = httpx.post(
        f"{s.gateway.url}/tokenize", json=body, headers={"authorization": "Bearer tenant-b"}
    )
    assert other.headers["cf-aig-cache-status"] == "MISS"
    text = s.http.post("/detokenize", json={"model": "tiny-chat", "tokens": tokens})
    assert text.status_code == 200 and "Hello there" in text.json()["prompt"]
    rerank_tokens = s.http.post("/tokenize", json={"model": RERANKER, "prompt": QUERY})
    assert rerank_tokens.status_code == 200 and rerank_tokens.json()["count"] > 0
    assert s.http.post("/tokenize", json={"model": "tiny-chat"}).status_code == 400
    assert s.http.post("/detokenize", json={"model": "nope", "tokens": [1]}).status_code == 404


def test_scoring_texts_are_redacted_or_blocked_before_vllm(s: Setup) -> None:
    """The query and the documents are prompts: a card is scored, keyed and echoed as its
    placeholder (the score is vLLM's for the placeholder text; a second card makes the same
    pairs), or the request is refused in each route's error format before vLLM sees it."""
    rng = random.Random(50)
    first, second = card(rng), card(rng)
    doc = SENTENCES["CREDIT_CARD"]
    placeholder = doc.format("<CREDIT_CARD>")
    direct = httpx.post(
        f"{s.vllm_url}/rerank",
        json={"model": SERVED, "query": QUERY, "documents": [placeholder, DOCS[0]]},
    ).json()
    expected = {r["index"]: r["relevance_score"] for r in direct["results"]}
    body = {"model": RERANKER, "query": QUERY, "documents": [doc.format(first), DOCS[0]]}
    got = httpx.post(f"{s.gateway.url}/v1/rerank", json=body, headers=REDACT)
    assert got.status_code == 200, got.text
    assert got.headers["x-semcache-dlp-prompt"] == "CREDIT_CARD=redact"
    assert first not in got.text
    for r in got.json()["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-3)
    assert {r["document"]["text"] for r in got.json()["results"]} == {placeholder, DOCS[0]}
    before = s.scored()
    body["documents"][0] = doc.format(second)
    again = httpx.post(f"{s.gateway.url}/v1/rerank", json=body, headers=REDACT)
    assert again.headers["cf-aig-cache-status"] == "HIT" and second not in again.text
    assert s.scored() == before  # the redacted form's key: nothing reached vLLM
    score = httpx.post(
        f"{s.gateway.url}/v1/score",
        json={"model": RERANKER, "text_1": doc.format(first), "text_2": DOCS[0]},
        headers=REDACT,
    )
    assert score.status_code == 200 and score.headers["x-semcache-dlp-prompt"], score.text

    before = s.scored()
    refused = httpx.post(f"{s.gateway.url}/v1/rerank", json=body, headers=BLOCK)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "prompt_blocked"
    run = f"{s.gateway.url}/client/v4/accounts/acc/ai/run/{RERANKER}"
    contexts = [{"text": DOCS[0]}, {"text": DOCS[1]}]
    wa = httpx.post(run, json={"query": doc.format(first), "contexts": contexts}, headers=BLOCK)
    assert wa.status_code == 400 and wa.json()["success"] is False
    assert "CREDIT_CARD" in wa.json()["errors"][0]["message"] and first not in wa.text
    assert s.scored() == before  # neither reached vLLM
    wa = httpx.post(run, json={"query": doc.format(first), "contexts": contexts}, headers=REDACT)
    assert wa.status_code == 200 and wa.headers["x-semcache-dlp-prompt"], wa.text
