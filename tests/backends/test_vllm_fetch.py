"""VllmClient.fetch: a stored Responses API answer is asked of every server until one has it
(each vLLM server keeps only the responses it made), against local servers."""

from __future__ import annotations

from aiohttp import web

from backends.config import VllmBackendConfig, VllmServer
from backends.vllm.client import VllmClient
from foundation.request import RequestContext
from harness.fake_vllm import FakeServer

CTX = RequestContext(request_id="r")


def keeper(kept: dict[str, bytes]) -> FakeServer:
    async def handler(request: web.Request) -> web.StreamResponse:
        found = kept.get(request.path.rsplit("/", 1)[-1])
        if found is None:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.Response(body=found, content_type="application/json")

    return FakeServer(handler)


async def test_the_server_that_kept_the_response_answers() -> None:
    empty, holder = keeper({}), keeper({"resp_1": b'{"id":"resp_1"}'})
    down = keeper({})  # never started: its connections are refused
    for server in (empty, holder):
        await server.start()
    servers = [VllmServer(url=s.url) for s in (down, empty, holder)]
    client = VllmClient(VllmBackendConfig(name="b", served_model="m", servers=servers))
    try:
        found = await client.fetch("/v1/responses/resp_1", CTX)
        assert found is not None and found.status == 200 and found.body == b'{"id":"resp_1"}'
        missing = await client.fetch("/v1/responses/resp_2", CTX)
        assert missing is not None and missing.status == 404
    finally:
        await client.aclose()
        for server in (empty, holder):
            await server.stop()


async def test_no_server_to_ask_is_none() -> None:
    down = keeper({})
    client = VllmClient(
        VllmBackendConfig(name="b", served_model="m", servers=[VllmServer(url=down.url)])
    )
    try:
        assert await client.fetch("/v1/responses/resp_1", CTX) is None
    finally:
        await client.aclose()
