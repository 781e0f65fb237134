"""DLP and guardrails through ``semcache serve`` on real vLLM (behind a recording proxy, so
the test reads what vLLM received): per entity type (and per credential pattern) a prompt
flagged, redacted or blocked on the OpenAI and Workers-AI routes; ``/tokenize``,
``count_tokens`` and ``/detokenize``; a whole JSON answer and a streamed one (its value split
across chunks) redacted or blocked, and what the cache then holds; two prompts differing in a
redacted value as one entry; the request log's findings; the Responses API's ``instructions``
and ``input``, Anthropic's error shapes on ``/v1/messages``, ``/v1/classify`` keyed by the
redacted input; the embedded classifier as a guardrail that blocks or flags; a per-key patch;
a policy reload making stored answers miss; and no value sent anywhere in the gateway's logs,
metrics, traces, request log or data directory."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w

from backends.config import EmbeddedClassifierConfig, VllmBackendConfig, VllmServer
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.otlp_receiver import OtlpReceiver
from harness.vllm_process import TINY_MODEL_NAME
from server.config import ModelEntry
from server.identity.auth import AuthSettings, TokenEntry
from server.telemetry import TracingSettings
from tests.conftest import gateway_config
from tests.support.dlp_values import GENERATORS, SENTENCES, card, entity_of
from tests.support.recording_proxy import RecordingProxy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CASES = sorted(GENERATORS)
TYPES = sorted({entity_of(case) for case in CASES})
TENANTS = ("redact", "block", "flag", "stream", "cut", "rails", "railflag", "anyword", "reload")
WA = "/client/v4/accounts/acc/ai/run/@cf/test/tiny"


def policy() -> dict[str, Any]:
    per_type = {action: dict.fromkeys(TYPES, action) for action in ("redact", "block", "flag")}
    return {
        "version": 1,
        "defaults": {"log_bodies": True},  # the request log keeps bodies, but never these
        "guard": {
            "hold_back_chars": 16,
            # any word: an answer rule every answer of the random-weight model sets off
            "detectors": {"ANY_WORD": {"patterns": [r"\w+"]}},
            "keys": {"strict": {"dlp": {"prompt": {"CREDIT_CARD": "block"}}}},
            "tenants": {
                **{t: {"dlp": {"prompt": per_type[t]}} for t in ("redact", "block", "flag")},
                "stream": {"dlp": {"answer": {"CREDIT_CARD": "redact"}}},
                "cut": {"dlp": {"answer": {"CREDIT_CARD": "block"}}},
                "rails": {
                    "guardrails": {
                        "model": "sentiment-minilm",
                        "prompt": {"negative": {"threshold": 0.7, "action": "block"}},
                    }
                },
                "railflag": {
                    "guardrails": {
                        "model": "sentiment-minilm",
                        "prompt": {"negative": {"threshold": 0.7, "action": "flag"}},
                        # threshold 0: every answer is flagged
                        "answer": {"negative": {"threshold": 0.0, "action": "flag"}},
                    }
                },
                "anyword": {"dlp": {"answer": {"ANY_WORD": "block"}}},
                "reload": {"dlp": {"prompt": {"EMAIL_ADDRESS": "flag"}}},
            },
        },
    }


class Live:
    def __init__(self, gw: GatewayProcess, proxy: RecordingProxy, otlp: OtlpReceiver, data: Path):
        self.gw, self.proxy, self.otlp, self.data = gw, proxy, otlp, data
        self.sent: list[str] = []
        """Every value sent: none may be found in the gateway's outputs."""

    def post(self, tenant: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        sent = {"authorization": f"Bearer tok-{tenant}", **headers}
        return httpx.post(self.gw.url + path, json=body, headers=sent, timeout=120)

    def logged(self, request_id: str) -> dict[str, Any]:
        """The request log's line of ``request_id`` (written within a second or so)."""

        def line() -> dict[str, Any] | None:
            for path in self.data.rglob("requests.jsonl*"):
                for raw in path.read_text().splitlines():
                    doc = json.loads(raw)
                    if doc.get("request_id") == request_id:
                        return dict(doc)
            return None

        wait_until(lambda: line() is not None, 30)
        found = line()
        assert found is not None
        return found


@pytest.fixture(scope="module")
def live(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    proxy = RecordingProxy(tiny_vllm.url).start()
    otlp = OtlpReceiver().start()
    root = tmp_path_factory.mktemp("dlp")
    policy_path = root / "policy.toml"
    policy_path.write_text(tomli_w.dumps(policy()))
    config = gateway_config(
        root / "data",
        proxy.url,
        data_dir / "models" / TINY_MODEL_NAME,
        policy=str(policy_path),
        auth=AuthSettings(
            tokens=[
                *(TokenEntry(tenant=t, token=f"tok-{t}") for t in TENANTS),
                # a second token of the tenant "redact", patched by `[guard.keys.strict]`
                TokenEntry(tenant="redact", token="tok-strict", name="strict"),
                TokenEntry(tenant="ops", token="tok-ops", roles=["admin"]),
            ]
        ),
        tracing=TracingSettings(endpoint=otlp.endpoint),
    )
    config.models.append(
        ModelEntry(id="sentiment-minilm", backend="sentiment", task="classification")
    )
    config.backends.append(EmbeddedClassifierConfig(name="sentiment"))
    chat = config.backends[0]
    assert isinstance(chat, VllmBackendConfig) and chat.servers == [VllmServer(url=proxy.url)]
    gw = GatewayProcess(write_config_toml(config, root / "gateway.toml")).start()
    try:
        yield Live(gw, proxy, otlp, root / "data")
    finally:
        gw.stop()
        otlp.stop()
        proxy.stop()


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }


def test_each_type_redacted_before_vllm_on_both_routes(live: Live) -> None:
    rng = random.Random(50)
    for case in CASES:
        entity = entity_of(case)
        for path in ("/v1/chat/completions", WA):
            value = GENERATORS[case](rng)
            live.sent.append(value)
            body = chat(SENTENCES[case].format(value))
            if path == WA:
                body = {"messages": body["messages"], "max_tokens": 2}
            before = len(live.proxy.bodies)
            got = live.post("redact", path, body)
            assert got.status_code == 200, got.text
            assert got.headers["x-semcache-dlp-prompt"] == f"{entity}=redact"
            received = b"\n".join(live.proxy.bodies[before:]).decode()
            assert f"<{entity}>" in received and json.dumps(value)[1:-1] not in received


def test_each_type_blocked_in_the_route_format_before_vllm(live: Live) -> None:
    rng = random.Random(51)
    for case in CASES:
        entity = entity_of(case)
        value = GENERATORS[case](rng)
        live.sent.append(value)
        before = len(live.proxy.bodies)
        got = live.post("block", "/v1/chat/completions", chat(SENTENCES[case].format(value)))
        assert got.status_code == 400
        assert got.json()["error"]["code"] == "prompt_blocked"
        assert entity in got.json()["error"]["message"]
        got = live.post("block", WA, {"prompt": SENTENCES[case].format(value)})
        assert got.status_code == 400 and got.json()["success"] is False
        assert entity in got.json()["errors"][0]["message"]
        assert len(live.proxy.bodies) == before  # nothing reached vLLM


def test_each_type_flagged_and_sent_on(live: Live) -> None:
    rng = random.Random(52)
    for case in CASES:
        entity = entity_of(case)
        value = GENERATORS[case](rng)
        live.sent.append(value)
        got = live.post(
            "flag",
            "/v1/completions",
            {
                "model": "tiny-chat",
                "prompt": SENTENCES[case].format(value),
                "max_tokens": 2,
            },
        )
        assert got.status_code == 200, got.text
        assert got.headers["x-semcache-dlp-prompt"] == f"{entity}=flag"
        assert json.dumps(value)[1:-1].encode() in live.proxy.bodies[-1]


def test_embeddings_inputs_redacted_and_blocked(live: Live) -> None:
    value = "jane.doe.77@example.org"
    live.sent.append(value)
    text = SENTENCES["EMAIL_ADDRESS"]
    body = {"model": "all-MiniLM-L6-v2", "input": [text.format(value), "no value here"]}
    got = live.post("redact", "/v1/embeddings", body)
    assert got.status_code == 200 and got.headers["x-semcache-dlp-prompt"] == "EMAIL_ADDRESS=redact"
    plain = {"model": "all-MiniLM-L6-v2", "input": [text.format("<EMAIL_ADDRESS>")]}
    direct = live.post("ops", "/v1/embeddings", plain).json()["data"][0]["embedding"]
    assert got.json()["data"][0]["embedding"] == pytest.approx(direct, abs=1e-6)
    refused = live.post("block", "/v1/embeddings", body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "prompt_blocked"


def test_tokenize_and_count_tokens_redacted_and_blocked(live: Live) -> None:
    """``/tokenize`` and Anthropic's ``count_tokens`` send the prompt to vLLM's tokenizer:
    the prompt rules apply, blocks in each route's own error shape."""
    rng = random.Random(55)
    value, other = card(rng), card(rng)
    live.sent += [value, other]
    text = SENTENCES["CREDIT_CARD"]
    for body in (
        {"model": "tiny-chat", "prompt": text.format(value)},
        {"model": "tiny-chat", "messages": [{"role": "user", "content": text.format(other)}]},
    ):
        before = len(live.proxy.bodies)
        got = live.post("redact", "/tokenize", body)
        assert got.status_code == 200, got.text
        assert got.headers["x-semcache-dlp-prompt"] == "CREDIT_CARD=redact"
        received = b"\n".join(live.proxy.bodies[before:]).decode()
        assert "<CREDIT_CARD>" in received and value not in received and other not in received
        refused = live.post("block", "/tokenize", body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "prompt_blocked"
    prompt = "How long is this? " + text.format(value)  # not the tokenization's: no hit
    messages = {"model": "tiny-chat", "messages": [{"role": "user", "content": prompt}]}
    before = len(live.proxy.bodies)
    counted = live.post("redact", "/v1/messages/count_tokens", messages)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text
    received = b"\n".join(live.proxy.bodies[before:]).decode()
    assert "<CREDIT_CARD>" in received and value not in received
    refused = live.post("block", "/v1/messages/count_tokens", messages)
    assert refused.status_code == 400
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "CREDIT_CARD" in refused.json()["error"]["message"]
    assert len(live.proxy.bodies) == before + 1  # the blocked one never reached vLLM


def test_detokenize_answers_under_the_answer_rules(live: Live) -> None:
    """A detokenization's answer is text: the answer rules redact it before the client and
    the cache (a repeat is a hit, still redacted) or block it."""
    value = card(random.Random(56))
    live.sent.append(value)
    tokenized = httpx.post(  # straight to vLLM: the gateway never sees the value as text
        live.proxy.url + "/tokenize",
        json={"model": TINY_MODEL_NAME, "prompt": SENTENCES["CREDIT_CARD"].format(value)},
        timeout=60,
    )
    body = {"model": "tiny-chat", "tokens": tokenized.json()["tokens"]}
    for status in ("MISS", "HIT"):
        got = live.post("stream", "/detokenize", body)
        assert got.status_code == 200, got.text
        assert got.headers["cf-aig-cache-status"] == status
        assert "<CREDIT_CARD>" in got.json()["prompt"] and value not in got.text
    refused = live.post("cut", "/detokenize", body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "response_blocked"
    assert value not in refused.text


def schema_for(value: str) -> dict[str, Any]:
    """An answer vLLM must give token by token: the value, split across chunks. A bare
    string, not an object: the JSON grammar allows whitespace between an object's tokens,
    which a random-weight model takes until ``max_tokens`` runs out."""
    return {
        "type": "json_schema",
        "json_schema": {"name": "card", "schema": {"type": "string", "enum": [value]}},
    }


def streamed(got: httpx.Response) -> tuple[str, list[dict[str, Any]]]:
    text, errors = "", []
    for line in got.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event or "errors" in event:
            errors.append(event)
        for choice in event.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
        text += event.get("response") or ""
    return text, errors


def test_a_streamed_value_split_across_chunks_is_redacted(live: Live) -> None:
    value = card(random.Random(53))
    live.sent.append(value)
    body = chat("Which card?", max_tokens=40, stream=True, response_format=schema_for(value))
    for _ in range(2):  # the live answer, then its replay from the cache
        got = live.post("stream", "/v1/chat/completions", body)
        assert got.status_code == 200
        text, errors = streamed(got)
        assert not errors and "<CREDIT_CARD>" in text and value not in text
    wa = {"messages": body["messages"], "max_tokens": 40, "stream": True}
    got = live.post("stream", WA, {**wa, "response_format": schema_for(value)})
    text, errors = streamed(got)
    assert not errors and "<CREDIT_CARD>" in text and value not in text


def test_a_block_mid_stream_ends_it_with_an_error_and_stores_nothing(live: Live) -> None:
    value = card(random.Random(54))
    live.sent.append(value)
    body = chat("Which card?", max_tokens=40, stream=True, response_format=schema_for(value))
    for _ in range(2):  # nothing was cached: the repeat reaches vLLM again
        before = len(live.proxy.bodies)
        got = live.post("cut", "/v1/chat/completions", body)
        text, errors = streamed(got)
        assert value not in text and errors[-1]["error"]["code"] == "response_blocked"
        assert len(live.proxy.bodies) == before + 1
    got = live.post(
        "cut",
        WA,
        {
            "messages": body["messages"],
            "max_tokens": 40,
            "stream": True,
            "response_format": schema_for(value),
        },
    )
    text, errors = streamed(got)
    assert value not in text and "CREDIT_CARD" in errors[-1]["errors"][0]["message"]


def test_the_embedded_classifier_as_a_guardrail(live: Live) -> None:
    bad = live.post("rails", "/v1/chat/completions", chat("This is terrible, awful and I hate it."))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "prompt_blocked"
    assert "negative" in bad.json()["error"]["message"]
    good = live.post("rails", "/v1/chat/completions", chat("What a lovely, wonderful day!"))
    assert good.status_code == 200


def test_a_whole_json_answer_redacted_or_blocked_and_stored_so(live: Live) -> None:
    """Answer rules on a non-streamed answer: the value is redacted before the client and
    the cache see it (the repeat is a hit, still redacted), or the answer is refused and
    nothing is stored (the repeat reaches vLLM again); the request log names the finding."""
    value = card(random.Random(57))
    live.sent.append(value)
    body = chat("Which card?", max_tokens=40, response_format=schema_for(value))
    for status in ("MISS", "HIT"):
        got = live.post(
            "stream", "/v1/chat/completions", body, **{"x-request-id": f"json-{status}"}
        )
        assert got.status_code == 200, got.text
        assert got.headers["cf-aig-cache-status"] == status
        content = got.json()["choices"][0]["message"]["content"]
        assert "<CREDIT_CARD>" in content and value not in got.text
        if status == "MISS":
            assert got.headers["x-semcache-dlp-answer"] == "CREDIT_CARD=redact"
    line = live.logged("json-MISS")
    assert line["findings"] == ["answer:CREDIT_CARD:redact"] and "response_body" not in line
    for _ in range(2):
        before = len(live.proxy.bodies)
        refused = live.post("cut", "/v1/chat/completions", body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "response_blocked" and value not in refused.text
        assert len(live.proxy.bodies) == before + 1  # nothing was stored


def test_a_redacted_prompt_is_keyed_by_its_redacted_form(live: Live) -> None:
    """Two prompts that differ only in a redacted card are one cache entry: vLLM never saw
    the card, so its answer cannot depend on it. The request log names each finding."""
    rng = random.Random(58)
    first, second = card(rng), card(rng)
    live.sent += [first, second]
    text = "Keyed by its redacted form: " + SENTENCES["CREDIT_CARD"]
    before = len(live.proxy.bodies)
    got = live.post("redact", "/v1/chat/completions", chat(text.format(first)))
    assert got.status_code == 200 and got.headers["cf-aig-cache-status"] == "MISS", got.text
    assert len(live.proxy.bodies) == before + 1
    again = live.post(
        "redact", "/v1/chat/completions", chat(text.format(second)), **{"x-request-id": "keyed"}
    )
    assert again.status_code == 200 and again.headers["cf-aig-cache-status"] == "HIT"
    assert again.headers["x-semcache-dlp-prompt"] == "CREDIT_CARD=redact"
    assert again.json() == got.json()
    assert len(live.proxy.bodies) == before + 1  # the second never reached vLLM
    line = live.logged("keyed")
    assert line["findings"] == ["prompt:CREDIT_CARD:redact"] and line["tenant"] == "redact"
    assert "request_body" not in line  # an inspected request's bodies are never logged


def test_responses_input_and_instructions_redacted_and_streams_refused(live: Live) -> None:
    """The Responses API's ``instructions`` and ``input`` are prompt texts: redacted before
    vLLM. Its streamed answers are named events the answer rules cannot read: refused."""
    rng = random.Random(60)
    first, second = card(rng), card(rng)
    live.sent += [first, second]
    body = {
        "model": "tiny-chat",
        "instructions": "Never repeat card " + first + ".",
        "input": SENTENCES["CREDIT_CARD"].format(second),
        "max_output_tokens": 4,
        "temperature": 0,
        "store": False,
    }
    before = len(live.proxy.bodies)
    got = live.post("redact", "/v1/responses", body)
    assert got.status_code == 200, got.text
    assert got.headers["x-semcache-dlp-prompt"] == "CREDIT_CARD=redact"
    received = b"\n".join(live.proxy.bodies[before:]).decode()
    assert received.count("<CREDIT_CARD>") == 2
    assert first not in received and second not in received
    before = len(live.proxy.bodies)
    refused = live.post("stream", "/v1/responses", {**body, "stream": True})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "stream"
    assert len(live.proxy.bodies) == before  # refused before vLLM


def anthropic_events(got: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events, name = [], ""
    for line in got.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def test_messages_blocks_in_anthropic_shapes(live: Live) -> None:
    """``/v1/messages``: a prompt block is Anthropic's error JSON (400, nothing sent to
    vLLM); an answer blocked mid-stream ends with Anthropic's ``error`` event, no
    ``message_stop``. The random-weight model cannot be made to say a given value here
    (Messages has no ``response_format``): a custom detector matching any word stands in."""
    value = card(random.Random(61))
    live.sent.append(value)
    body = {
        "model": "tiny-chat",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": SENTENCES["CREDIT_CARD"].format(value)}],
    }
    before = len(live.proxy.bodies)
    refused = live.post("block", "/v1/messages", body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "CREDIT_CARD" in refused.json()["error"]["message"] and value not in refused.text
    assert len(live.proxy.bodies) == before
    got = live.post("redact", "/v1/messages", body)
    assert got.status_code == 200 and got.json()["type"] == "message", got.text
    received = live.proxy.bodies[-1].decode()
    assert "<CREDIT_CARD>" in received and value not in received
    streamed_body = {
        "model": "tiny-chat",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Say something."}],
    }
    got = live.post("anyword", "/v1/messages", streamed_body)
    assert got.status_code == 200, got.text
    events = anthropic_events(got)
    assert events[0][0] == "message_start"
    name, last = events[-1]
    assert name == "error" and last["type"] == "error", events
    assert "ANY_WORD" in last["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]


def test_classification_input_redacted_before_the_classifier_and_the_key(live: Live) -> None:
    """``/v1/classify`` on the embedded classifier: the input is classified (and keyed) as
    its redacted form, so two inputs differing only in the card are one entry."""
    rng = random.Random(62)
    first, second = card(rng), card(rng)
    live.sent += [first, second]
    text = "Classify this: " + SENTENCES["CREDIT_CARD"]
    got = live.post(
        "redact", "/v1/classify", {"model": "sentiment-minilm", "input": text.format(first)}
    )
    assert got.status_code == 200, got.text
    assert got.headers["x-semcache-dlp-prompt"] == "CREDIT_CARD=redact"
    assert got.headers["cf-aig-cache-status"] == "MISS"
    again = live.post(
        "redact", "/v1/classify", {"model": "sentiment-minilm", "input": text.format(second)}
    )
    assert again.status_code == 200 and again.headers["cf-aig-cache-status"] == "HIT"
    assert again.json()["data"] == got.json()["data"]
    plain = {"model": "sentiment-minilm", "input": text.format("<CREDIT_CARD>")}
    direct = live.post("ops", "/v1/classify", plain)
    assert direct.status_code == 200, direct.text
    assert got.json()["data"][0]["probs"] == pytest.approx(
        direct.json()["data"][0]["probs"], abs=1e-6
    )
    refused = live.post(
        "block", "/v1/classify", {"model": "sentiment-minilm", "input": text.format(first)}
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "prompt_blocked"


def decisions(live: Live, action: str, direction: str) -> float:
    """The gateway's count of guardrail decisions on ``negative`` (0 before the first)."""
    want = (
        "semcache_guardrail_decisions_total"
        f'{{action="{action}",category="negative",direction="{direction}"}} '
    )
    lines = httpx.get(live.gw.url + "/metrics").text.splitlines()
    return float(next((line.split()[-1] for line in lines if line.startswith(want)), 0))


def test_a_guardrail_that_flags_serves_the_answer_and_counts_it(live: Live) -> None:
    """A guardrail's ``flag`` on the prompt and on the answer (whole, and a stream's end):
    the answer is served, each decision counted and logged; a score below the threshold is
    counted as ``pass``."""
    answer_flags = decisions(live, "flag", "answer")
    got = live.post(
        "railflag",
        "/v1/chat/completions",
        chat("This is terrible, awful and I hate it."),
        **{"x-request-id": "rail-flag"},
    )
    assert got.status_code == 200, got.text
    flags = {d: decisions(live, "flag", d) for d in ("prompt", "answer")}
    assert flags["prompt"] >= 1 and flags["answer"] == answer_flags + 1
    assert decisions(live, "pass", "prompt") >= 1  # the lovely day of the blocking guardrail's test
    line = "guard: guardrail negative flag in the prompt (request rail-flag)"
    wait_until(lambda: line in "".join(live.gw.lines), 10)
    findings = live.logged("rail-flag")["findings"]
    assert sorted(findings) == ["answer:negative:flag", "prompt:negative:flag"]
    streamed_body = chat("Another stream, flagged at its end.", max_tokens=4, stream=True)
    got = live.post("railflag", "/v1/chat/completions", streamed_body)
    assert got.status_code == 200 and got.text.rstrip().endswith("data: [DONE]"), got.text
    assert decisions(live, "flag", "answer") == flags["answer"] + 1


def test_a_key_patch_blocks_for_its_token_only(live: Live) -> None:
    """``[guard.keys.strict]`` patches the rule of the token named ``strict`` only: the same
    prompt is redacted for the tenant's other token and blocked for this one."""
    value = card(random.Random(63))
    live.sent.append(value)
    body = chat("Per key: " + SENTENCES["CREDIT_CARD"].format(value))
    got = live.post("redact", "/v1/chat/completions", body)
    assert got.status_code == 200 and got.headers["x-semcache-dlp-prompt"] == "CREDIT_CARD=redact"
    before = len(live.proxy.bodies)
    refused = live.post("strict", "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "prompt_blocked"
    assert len(live.proxy.bodies) == before


def test_metrics_and_no_value_anywhere(live: Live) -> None:
    metrics = httpx.get(live.gw.url + "/metrics").text
    for line in (
        'semcache_dlp_findings_total{action="redact",direction="prompt",entity="CREDIT_CARD"}',
        'semcache_dlp_findings_total{action="block",direction="answer",entity="CREDIT_CARD"}',
        'semcache_guardrail_decisions_total{action="block",category="negative",direction="prompt"}',
        'semcache_guard_duration_seconds_count{direction="stream"}',
    ):
        assert line in metrics, line
    ops = {"authorization": "Bearer tok-ops"}
    panel = httpx.get(live.gw.url + "/dashboard/api/overview", headers=ops).json()["content"]
    assert {"kind": "dlp", "direction": "prompt", "name": "CREDIT_CARD", "action": "redact"} in [
        {k: v for k, v in row.items() if k != "count"} for row in panel
    ]
    page = httpx.get(live.gw.url + "/dashboard/overview", headers=ops).text
    assert 'data-content="prompt:CREDIT_CARD:block"' in page

    def guard_spans() -> list[Any]:  # exported in batches: a few seconds after the requests
        return live.otlp.matching(lambda s: s.name == "guard.prompt")

    wait_until(guard_spans, 60)
    logged = "".join(live.gw.lines)
    assert "guard: dlp CREDIT_CARD flag in the prompt (request " in logged
    outputs = [
        metrics,
        page,
        "".join(live.gw.lines),
        repr([s.attributes for s in live.otlp.matching(lambda s: True)]),
    ]
    files = [p for p in live.data.rglob("*") if p.is_file()]
    assert any(p.name.startswith("requests.jsonl") for p in files)
    blobs = [p.read_bytes() for p in files]
    assert live.sent
    for value in live.sent:
        for text in outputs:
            assert value not in text
        raw = value.encode()
        escaped = json.dumps(value)[1:-1].encode()
        for path, blob in zip(files, blobs, strict=True):
            assert raw not in blob and escaped not in blob, path


def test_zz_a_policy_reload_makes_stored_answers_miss(live: Live) -> None:
    """The rules' version is in the cache key: after the policy file changes a tenant's
    rules and is reloaded, the same request is a miss; with the old rules back, the answer
    stored under them is a hit again. Last in the module: it rewrites the shared policy."""
    path = live.data.parent / "policy.toml"
    ops = {"authorization": "Bearer tok-ops"}
    body = chat("A request the reload changes the rules of.")
    statuses = [live.post("reload", "/v1/chat/completions", body) for _ in range(2)]
    assert [r.headers["cf-aig-cache-status"] for r in statuses] == ["MISS", "HIT"]
    changed = policy()
    changed["guard"]["tenants"]["reload"]["dlp"]["prompt"]["EMAIL_ADDRESS"] = "redact"
    try:
        path.write_text(tomli_w.dumps(changed))
        assert httpx.post(live.gw.url + "/admin/policy/reload", headers=ops).status_code == 200
        got = live.post("reload", "/v1/chat/completions", body)
        assert got.status_code == 200 and got.headers["cf-aig-cache-status"] == "MISS"
    finally:
        path.write_text(tomli_w.dumps(policy()))
        assert httpx.post(live.gw.url + "/admin/policy/reload", headers=ops).status_code == 200
    got = live.post("reload", "/v1/chat/completions", body)
    assert got.headers["cf-aig-cache-status"] == "HIT"
