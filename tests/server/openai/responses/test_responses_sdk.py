"""``client.responses`` of the official openai SDK against the real gateway in front of a real
vLLM (the tiny Llama): answers as vLLM gives them, stateless ones cached (JSON and streams,
replayed byte for byte), stateful ones passed through, stored responses fetched by id."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME

pytestmark = pytest.mark.slow

HEADERS = {"authorization": "Bearer test"}


@pytest.fixture
def gw(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="test", max_retries=0)


@pytest.fixture
def direct(tiny_vllm: VllmProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_vllm.url}/v1", api_key="test", max_retries=0)


def stateless(**extra: Any) -> dict[str, Any]:
    """A request the cache may answer, with an input no other test sends."""
    return {
        "input": f"Tell me about spring, {uuid.uuid4().hex[:8]}.",
        "instructions": "You are terse.",
        "max_output_tokens": 12,
        "temperature": 0,
        "store": False,
        **extra,
    }


def test_a_stateless_response_is_vllms_answer_then_a_cache_hit(
    gw: openai.OpenAI, direct: openai.OpenAI
) -> None:
    kw = stateless()
    miss = gw.responses.with_raw_response.create(model="tiny-chat", **kw)
    assert miss.headers["cf-aig-cache-status"] == "MISS"
    first = miss.parse()
    ref = direct.responses.create(model=TINY_MODEL_NAME, **kw)
    assert first.output_text and first.output_text == ref.output_text
    assert first.usage is not None and first.usage.output_tokens == 12
    hit = gw.responses.with_raw_response.create(model="@cf/test/tiny", **kw)  # an alias
    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert int(hit.headers["x-semcache-saved-tokens"]) == first.usage.total_tokens
    assert hit.parse().model_dump() == first.model_dump()  # the stored answer, id included


def test_a_stateless_stream_is_relayed_then_replayed_byte_for_byte(
    gw: openai.OpenAI, direct: openai.OpenAI, gateway: GatewayProcess
) -> None:
    kw = stateless(stream=True)
    events = list(gw.responses.create(model="tiny-chat", **kw))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == events[-1].response.output_text
    ref = direct.responses.create(model=TINY_MODEL_NAME, **{**kw, "stream": False})
    assert text == ref.output_text
    body = {"model": "tiny-chat", **kw}
    hit = httpx.post(f"{gateway.url}/v1/responses", json=body, headers=HEADERS, timeout=60)
    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert hit.content.startswith(b"event: response.created\ndata: ")
    again = httpx.post(f"{gateway.url}/v1/responses", json=body, headers=HEADERS, timeout=60)
    assert again.content == hit.content
    replayed = list(gw.responses.create(model="tiny-chat", **kw))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events]
    # a JSON request is cached under a key of its own
    json_miss = gw.responses.with_raw_response.create(model="tiny-chat", **{**kw, "stream": False})
    assert json_miss.headers["cf-aig-cache-status"] == "MISS"
    assert json_miss.parse().output_text == text


def test_stateful_requests_pass_through_uncached(gw: openai.OpenAI) -> None:
    kw = {**stateless(), "max_output_tokens": 4}
    del kw["store"]  # OpenAI's default, and vLLM's: store
    first = gw.responses.with_raw_response.create(model="tiny-chat", **kw)
    second = gw.responses.with_raw_response.create(model="tiny-chat", **kw)
    assert "cf-aig-cache-status" not in first.headers
    assert "cf-aig-cache-status" not in second.headers
    assert first.parse().id != second.parse().id
    streamed = list(gw.responses.create(model="tiny-chat", stream=True, **kw))
    assert streamed[-1].type == "response.completed"


def test_bad_input_is_an_openai_error(gw: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        gw.responses.create(model="nope", input="hi")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as missing:
        gw.responses.create(model="tiny-chat")
    assert isinstance(missing.value.body, dict) and missing.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        gw.responses.create(model="tiny-chat", input="hi", temperature=5)


def test_stored_responses_are_fetched_and_continued(gw: openai.OpenAI) -> None:
    """The session's vLLM keeps what it is asked to store: fetched by id and continued
    through the gateway, and an id it does not hold is a 404 in OpenAI's shape."""
    kw = {**stateless(), "store": True}
    made = gw.responses.create(model="tiny-chat", **kw)
    assert gw.responses.retrieve(made.id).model_dump() == made.model_dump()
    streamed = list(gw.responses.create(model="tiny-chat", stream=True, **kw))
    done = streamed[-1]
    assert done.type == "response.completed"
    assert gw.responses.retrieve(done.response.id).output_text == done.response.output_text
    follow = gw.responses.create(
        model="tiny-chat", input="And in summer?", previous_response_id=made.id, max_output_tokens=4
    )
    assert follow.previous_response_id == made.id
    for gone in (f"resp_{uuid.uuid4().hex}", "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as missing:
            gw.responses.retrieve(gone)
        assert isinstance(missing.value.body, dict)
        assert missing.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):  # vLLM's own answer, relayed
        gw.responses.create(model="tiny-chat", input="x", previous_response_id="resp_unknown")
