"""``GET /v1/models``: the model card and the list of them."""

from __future__ import annotations

from typing import Literal

import msgspec

from backends.registry import ModelInfo, Task


class ModelCard(msgspec.Struct, kw_only=True):
    """OpenAI's model object, with the gateway's task, aliases and weights revision."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    task: Task
    aliases: list[str]
    revision: str

    @classmethod
    def of(cls, info: ModelInfo) -> ModelCard:
        return cls(
            id=info.id,
            created=info.created,
            owned_by=info.owned_by,
            task=info.task,
            aliases=list(info.aliases),
            revision=info.revision,
        )


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]
