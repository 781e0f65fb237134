"""The dashboard as an operator sees it: the real ``semcache serve`` process over real vLLM, known
traffic (10 chat requests, 4 of them repeats, one batch, one purge), and every page opened in
Debian's Chromium, driven by Playwright.

The figures on the pages must equal the JSON endpoints', ``/metrics``' and the traffic sent;
the purge form asks first and purges; no page logs a console error or fetches an outside URL;
without the admin token every page is refused.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from playwright.async_api import expect

from backends.launch.process import VllmProcess
from harness.browser import Watched, chromium, chromium_binary, log_in
from harness.gateway import GatewayProcess, write_config_toml
from harness.metrics import parse_metric
from harness.vllm_process import TINY_MODEL_NAME
from server.dashboard.pages import PAGES
from server.identity.admin_token import AdminSettings
from server.identity.auth import AuthSettings
from tests.conftest import gateway_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ADMIN = "dashboard-admin"
AUTH = {"authorization": f"Bearer {ADMIN}"}
TENANT = {"authorization": "Bearer tenant-key"}  # the tenant whose answers are cached
CHAT = "/v1/chat/completions"
PROMPTS = ["apples", "pears", "plums", "apples", "cherries", "pears", "figs", "apples", "kiwis"]
PROMPTS += ["plums"]  # 10 requests, 6 distinct texts: 4 repeats
POLICY = """
version = 1
[tiers.memory]
max_bytes = 16_000_000
[tiers.disk]
dir = "cache"
[defaults]
ttl_s = 600
[defaults.prices]
input_per_m = 0.045
output_per_m = 0.384
"""


@pytest.fixture(scope="module")
def browser_binary() -> str:
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is missing and `scripts/chromium.sh install` could not install it")
    return binary


@pytest.fixture(scope="module")
def gw(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("dashboard")
    (tmp / "policy.toml").write_text(POLICY)
    config = gateway_config(
        tmp,
        tiny_vllm.url,
        data_dir / "models" / TINY_MODEL_NAME,
        embeddings=False,
        policy=str(tmp / "policy.toml"),
        auth=AuthSettings(admin=AdminSettings(token=ADMIN, token_env="")),  # whatever the env says
    )
    gateway = GatewayProcess(write_config_toml(config, tmp / "gateway.toml"))
    try:
        yield gateway.start()
    finally:
        gateway.stop()


def chat(client: httpx.Client, text: str) -> httpx.Response:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": f"Name three {text}."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    answer = client.post(CHAT, json=body)
    assert answer.status_code == 200, answer.text
    return answer


def run_batch(client: httpx.Client) -> str:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": f"A batch line about {fruit}."}],
                "max_tokens": 4,
                "temperature": 0,
            },
        }
        for i, fruit in enumerate(("limes", "dates"))
    ]
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    upload = client.post(
        "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}
    ).json()
    batch = client.post(
        "/v1/batches",
        json={"input_file_id": upload["id"], "endpoint": CHAT, "completion_window": "24h"},
    ).json()
    deadline = time.monotonic() + 300
    while client.get(f"/v1/batches/{batch['id']}").json()["status"] != "completed":
        assert time.monotonic() < deadline, "the batch did not complete"
        time.sleep(0.3)
    return str(batch["id"])


@pytest.fixture(scope="module")
def traffic(gw: GatewayProcess) -> dict[str, Any]:
    """The known traffic, sent once for the module; what the pages must show."""
    with httpx.Client(base_url=gw.url, timeout=120, headers=TENANT) as client:
        answers = [chat(client, text) for text in PROMPTS]
        batch_id = run_batch(client)
    statuses = [a.headers["cf-aig-cache-status"] for a in answers]
    saved = sum(int(a.headers.get("x-semcache-saved-tokens", "0")) for a in answers)
    return {"hits": statuses.count("HIT"), "tokens_saved": saved, "batch": batch_id}


@pytest.fixture
async def watched_page(
    gw: GatewayProcess, browser_binary: str
) -> AsyncIterator[tuple[Any, Watched]]:
    async with chromium(browser_binary) as browser:
        page = await browser.new_page()
        watched = Watched(gw.url)
        watched.attach(page)
        yield page, watched
        assert watched.console_errors == []
        assert watched.outside_requests == []


async def get(gw: GatewayProcess, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=120) as client:
        return await client.get(path)


async def api(gw: GatewayProcess, page: str) -> Any:
    return (await get(gw, f"/dashboard/api/{page}")).json()


async def chat_again(gw: GatewayProcess, text: str) -> str:
    """One more chat request; its cache status."""
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": f"Name three {text}."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    async with httpx.AsyncClient(base_url=gw.url, timeout=120, headers=TENANT) as client:
        answer = await client.post(CHAT, json=body)
    assert answer.status_code == 200, answer.text
    return answer.headers["cf-aig-cache-status"]


async def text(page: Any, selector: str) -> str:
    return str(await page.locator(selector).first.inner_text()).strip()


async def test_every_page_shows_the_traffic_sent(
    gw: GatewayProcess, traffic: dict[str, Any], watched_page: tuple[Any, Watched]
) -> None:
    page, _ = watched_page
    assert traffic["hits"] == 4
    await log_in(page, gw.url, ADMIN)
    metrics = (await get(gw, "/metrics")).text
    overview = await api(gw, "overview")
    assert overview["totals"]["exact_hits"] == 4
    assert overview["totals"]["tokens_saved"] == traffic["tokens_saved"] > 0
    assert parse_metric(metrics, "semcache_exact_hits_total") == 4
    await page.goto(f"{gw.url}/dashboard/overview")
    assert await text(page, "#exact-hits") == "4"
    assert await text(page, "#tokens-saved") == f"{traffic['tokens_saved']:,}"
    assert await text(page, "#requests") == f"{int(overview['totals']['requests']):,}"
    assert await page.locator("[data-status='200']").count() == 1
    await expect(page.locator(".chart canvas")).to_have_count(6)
    await page.click("[data-window='1h']")

    await page.goto(f"{gw.url}/dashboard/requests")
    row = page.locator("#by-route tr[data-route='/v1/chat/completions'][data-status='200']")
    assert await row.locator(".count").inner_text() == "10"
    if await page.locator("#log").count() == 0:  # until the request log exists
        assert (await text(page, "#log-note")).startswith("the request log is not available")

    await page.goto(f"{gw.url}/dashboard/tenants")
    models = {m["model"]: m for m in (await api(gw, "tenants"))["models"]}
    tokens = page.locator("#models tr[data-model='tiny-chat'] .tokens")
    assert await tokens.inner_text() == f"{int(models['tiny-chat']['tokens']):,}"
    assert await page.locator("#ledger, #ledger-note").count() == 1

    await page.goto(f"{gw.url}/dashboard/backends")
    (server,) = (await api(gw, "backends"))["servers"]
    cells = page.locator(f"#servers tr[data-server='{server['server']}']")
    assert await cells.locator(".requests").inner_text() == f"{int(server['requests']):,}"
    assert int(server["requests"]) >= 6 + 2  # the misses and the batch lines reached vLLM
    assert await cells.locator(".inflight").inner_text() == f"0 / {int(server['limit']):,}"

    await page.goto(f"{gw.url}/dashboard/batches?batch={traffic['batch']}")
    assert await text(page, "#batch-id") == traffic["batch"]
    assert await text(page, "#batch-status") == "completed"
    assert await text(page, "#batch-items") == "2 done, 0 failed of 2"
    assert await text(page, "#items-success") == "2"

    await page.goto(f"{gw.url}/dashboard/cache")
    memory = page.locator("#tiers tr[data-tier='memory'] .entries")
    assert await memory.inner_text() == f"{(await api(gw, 'cache'))['tiers'][0]['entries']:,}"
    for name in PAGES:  # every page loads clean (the fixture checks the console)
        assert (await page.goto(f"{gw.url}/dashboard/{name}")).status == 200


async def test_the_request_log_reads_as_times_models_and_servers_in_a_1400_px_window(
    gw: GatewayProcess,
    traffic: dict[str, Any],
    watched_page: tuple[Any, Watched],
    tmp_path: Path,
) -> None:
    page, _ = watched_page
    await page.set_viewport_size({"width": 1400, "height": 900})
    await log_in(page, gw.url, ADMIN)
    await page.goto(f"{gw.url}/dashboard/requests")
    logs = (await get(gw, "/admin/logs?limit=100")).json()["data"]
    line = next(line for line in logs if line["route"] == CHAT and line["servers"])
    row = page.locator(f"#log tr[data-request='{line['request_id']}']")
    when = await row.locator(".time").inner_text()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", when), when
    assert await row.locator(".model").inner_text() == "tiny-chat"
    assert await row.locator(".servers li").all_inner_texts() == line["servers"]
    assert "None" not in await page.locator("#log").inner_text()
    widths = await page.evaluate(
        """() => {
            const box = document.querySelector("#data .scroll");
            return {page: document.documentElement.scrollWidth, window: window.innerWidth,
                    box: box.getBoundingClientRect().right, table: box.scrollWidth,
                    shown: box.clientWidth, overflow: getComputedStyle(box).overflowX};
        }"""
    )
    assert widths["page"] <= widths["window"] == 1400, widths  # nothing runs off the window
    assert widths["box"] <= 1400, widths
    assert widths["table"] <= widths["shown"] or widths["overflow"] == "auto", widths
    shot = tmp_path / "requests.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


async def test_the_overview_refreshes_itself(
    gw: GatewayProcess, traffic: dict[str, Any], watched_page: tuple[Any, Watched]
) -> None:
    page, _ = watched_page
    await log_in(page, gw.url, ADMIN)
    before = int((await text(page, "#requests")).replace(",", ""))
    assert await chat_again(gw, "apples") == "HIT"
    await expect(page.locator("#requests")).to_have_text(f"{before + 1:,}", timeout=20_000)


async def test_the_purge_form_asks_first_then_purges(
    gw: GatewayProcess, traffic: dict[str, Any], watched_page: tuple[Any, Watched]
) -> None:
    page, _ = watched_page
    await log_in(page, gw.url, ADMIN)
    await page.goto(f"{gw.url}/dashboard/cache")
    await page.select_option("select[name=kind]", "model")
    await page.fill("input[name=target]", "tiny-chat")
    questions: list[str] = []

    async def dismiss(dialog: Any) -> None:
        questions.append(dialog.message)
        await dialog.dismiss()

    page.once("dialog", dismiss)
    await page.click("#purge button[type=submit]")
    await expect(page.locator("#purge-result")).to_have_text("purge cancelled")
    assert questions == ['Purge the cached answers of model "tiny-chat"? This cannot be undone.']
    assert (await api(gw, "cache"))["purges_by_kind"] == {}

    async def accept(dialog: Any) -> None:
        await dialog.accept()

    page.once("dialog", accept)
    await page.click("#purge button[type=submit]")
    await expect(page.locator("#purge-result")).to_have_text("purged: model tiny-chat")
    assert (await api(gw, "cache"))["purges_by_kind"] == {"model": 1}
    assert await page.locator("#purges-by-kind [data-kind='model']").inner_text() == "1"
    assert await page.locator("#recent-purges tbody tr").count() == 1
    assert await chat_again(gw, "apples") == "MISS"  # purged


async def test_without_the_admin_token_pages_are_refused(
    gw: GatewayProcess, traffic: dict[str, Any], watched_page: tuple[Any, Watched]
) -> None:
    page, watched = watched_page
    for name in PAGES:
        answer = await page.goto(f"{gw.url}/dashboard/{name}")
        assert answer.status == 401
        assert await page.locator("input[name=token]").count() == 1
        body = await page.content()
        assert "tiny-chat" not in body and 'id="data"' not in body
    await page.fill("input[name=token]", "not-the-token")
    await page.click("button[type=submit]")
    assert "admin role" in await page.locator("#refused").inner_text()
    # Fetched with the page's cookies, not navigated to: a JSON document has no icon link, so
    # Chromium would also ask for /favicon.ico and log its 404 whenever it lands.
    refused = await page.request.get(f"{gw.url}/dashboard/api/overview")
    assert refused.status == 403
    # the browser logs refused loads as console errors: expected here
    watched.console_errors.clear()
