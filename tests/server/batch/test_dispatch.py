"""Each queued item goes to the runner of the API that queued it."""

from __future__ import annotations

from typing import Any

from foundation.request import RequestContext
from server.batch.dispatch import ItemDispatch
from server.batch.results import ItemOutcome


class Runner:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def run_item(self, model: str, body: dict[str, Any], ctx: RequestContext) -> ItemOutcome:
        self.bodies.append(body)
        return ItemOutcome(success=True)


async def test_a_marked_payload_goes_to_its_runner_any_other_to_the_default() -> None:
    default, openai = Runner(), Runner()
    dispatch = ItemDispatch(default, {"openai_batch": openai})
    ctx = RequestContext(request_id="r")
    await dispatch.run_item("m", {"openai_batch": {"custom_id": "a"}}, ctx)
    await dispatch.run_item("m", {"prompt": "hi"}, ctx)
    await dispatch.run_item("m", {"openai_batch": "not an object"}, ctx)
    await dispatch.run_item("m", {"openai_batch": {}, "prompt": "two keys"}, ctx)
    assert openai.bodies == [{"custom_id": "a"}]
    assert default.bodies == [
        {"prompt": "hi"},
        {"openai_batch": "not an object"},
        {"openai_batch": {}, "prompt": "two keys"},
    ]
