"""``GET /v1/models`` and ``GET /v1/models/{model}``: the registry's models as cards.

A key scoped to some models sees only those (as OpenAI's project keys and LiteLLM's virtual
keys do): the others are left out of the list, and asking for one is the same 404 as for a
model that does not exist, so a scoped key learns nothing of what else the gateway serves.
"""

from __future__ import annotations

import msgspec

from backends.registry import ModelRegistry
from server.http.reply import Reply
from server.identity.auth import model_allowed
from server.openai.models.protocol import ModelCard, ModelList
from server.serving.core import unknown_model


class ModelsServing:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def list_models(self, allowed: frozenset[str] | None = None) -> Reply:
        """Every model, or only those a key scoped to ``allowed`` may use."""
        cards = [
            ModelCard.of(m)
            for m in self.registry.models.values()
            if model_allowed(allowed, m.id, m)
        ]
        return Reply(200, msgspec.json.encode(ModelList(data=cards)))

    def get_model(self, name: str, allowed: frozenset[str] | None = None) -> Reply:
        info = self.registry.resolve(name)
        if info is None or not model_allowed(allowed, name, info):
            raise unknown_model(name)
        return Reply(200, msgspec.json.encode(ModelCard.of(info)))
