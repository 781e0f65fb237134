"""``GET /v1/models`` and ``GET /v1/models/{model}``: the registry's models as cards."""

from __future__ import annotations

import msgspec

from backends.registry import ModelRegistry
from server.openai.models.protocol import ModelCard, ModelList
from server.openai.reply import Reply
from server.openai.state import unknown_model


class ModelsServing:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def list_models(self) -> Reply:
        cards = [ModelCard.of(m) for m in self.registry.models.values()]
        return Reply(200, msgspec.json.encode(ModelList(data=cards)))

    def get_model(self, name: str) -> Reply:
        info = self.registry.resolve(name)
        if info is None:
            raise unknown_model(name)
        return Reply(200, msgspec.json.encode(ModelCard.of(info)))
