"""The ``/v1`` surface's serving objects, one per endpoint family (as vLLM's
``entrypoints/openai``), built over the serving core; the app state holds each by name and
each family's routes take theirs from it."""

from __future__ import annotations

from dataclasses import dataclass, fields

from server.batch.system import BatchSystem
from server.openai.batches.runner import OpenAIItemRunner
from server.openai.batches.serving import BatchesServing
from server.openai.chat_completion.protocol import ChatCompletionRequest
from server.openai.completion.protocol import CompletionRequest, check_prompt
from server.openai.files.serving import FilesServing
from server.openai.models.serving import ModelsServing
from server.openai.pooling.serving import PoolingServing
from server.openai.responses.serving import ResponsesServing
from server.openai.scoring.serving import ScoringServing
from server.openai.stores import OpenAIStores
from server.openai.text_generation import TextGenerationServing
from server.openai.tokenization.serving import TokenizationServing
from server.serving.core import ServingCore
from server.serving.generation import Generation
from server.serving.pooling import Pooling
from server.serving.scoring import Scoring
from server.serving.tokenization import Tokenization


@dataclass(frozen=True)
class OpenAIFamilies:
    models: ModelsServing
    chat_completion: TextGenerationServing
    completion: TextGenerationServing
    responses: ResponsesServing
    pooling: PoolingServing
    files: FilesServing
    batches: BatchesServing
    tokenization: TokenizationServing
    """vLLM's ``/tokenize`` and ``/detokenize``."""
    scoring: ScoringServing
    """vLLM's ``/v1/score`` and ``/v1/rerank``."""

    def state(self) -> dict[str, object]:
        """The app state entries: one per family, under its name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def item_runner(self) -> OpenAIItemRunner:
        """What runs the lines of OpenAI batches on the batch workers."""
        calls = {
            "/v1/chat/completions": self.chat_completion.create,
            "/v1/completions": self.completion.create,
            "/v1/embeddings": self.pooling.embeddings,
        }
        return OpenAIItemRunner(calls, self.batches.stop_reason)


def build_openai(
    core: ServingCore,
    generation: Generation,
    pooling: Pooling,
    stores: OpenAIStores,
    batch_system: BatchSystem,
    tokens: Tokenization,
    *,
    max_file_bytes: int,
) -> OpenAIFamilies:
    settings = batch_system.settings
    return OpenAIFamilies(
        models=ModelsServing(core.registry),
        chat_completion=TextGenerationServing(
            core,
            generation,
            path="/v1/chat/completions",
            route="chat",
            schema=ChatCompletionRequest,
        ),
        completion=TextGenerationServing(
            core,
            generation,
            path="/v1/completions",
            route="completions",
            schema=CompletionRequest,
            check=check_prompt,
        ),
        responses=ResponsesServing(core, generation, stores.responses),
        pooling=PoolingServing(core, generation, pooling),
        files=FilesServing(stores.files, max_file_bytes),
        batches=BatchesServing(
            stores.batches,
            stores.files,
            core.registry,
            settings,
            queue_of=lambda: batch_system.queue,
        ),
        tokenization=TokenizationServing(core, tokens),
        scoring=ScoringServing(core, Scoring(core)),
    )
