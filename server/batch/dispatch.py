"""One runner for the batch workers over several APIs' items: a payload's marker key sends
it to its API's runner; any other payload goes to the default (Workers AI)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from foundation.request import RequestContext
from server.batch.results import ItemOutcome, ItemRunner


class ItemDispatch:
    """Routes each item to the runner of the API that queued it."""

    def __init__(self, default: ItemRunner, by_key: Mapping[str, ItemRunner]) -> None:
        self.default = default
        self.by_key = dict(by_key)

    async def run_item(self, model: str, body: dict[str, Any], ctx: RequestContext) -> ItemOutcome:
        if len(body) == 1:
            (key,) = body
            runner = self.by_key.get(key)
            if runner is not None and isinstance(body[key], dict):
                return await runner.run_item(model, body[key], ctx)
        return await self.default.run_item(model, body, ctx)
