"""Debian's Chromium driven by Playwright, for the dashboard's browser test and screenshots.

Needs the ``dev`` extra (``playwright``). Playwright's own browser downloads are never used:
``scripts/chromium.sh install`` installs Debian's ``chromium`` when it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from harness.vllm_process import REPO_ROOT


def chromium_binary() -> str | None:
    """The chromium binary; ``scripts/chromium.sh install`` is tried once when there is none."""
    found = shutil.which("chromium")
    if found:
        return found
    script = REPO_ROOT / "scripts" / "chromium.sh"
    try:
        subprocess.run(["bash", str(script), "install"], capture_output=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shutil.which("chromium")


@dataclass
class Watched:
    """What the pages did that an operator would not want: console errors, outside fetches."""

    origin: str
    console_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.console_errors.append(str(exc)))
        page.on("request", self._request)

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)

    def _request(self, request: Any) -> None:
        if not request.url.startswith((self.origin, "data:")):
            self.outside_requests.append(request.url)


@asynccontextmanager
async def chromium(binary: str) -> AsyncIterator[Any]:
    """A headless Chromium (Playwright's async API) on ``binary``."""
    from playwright.async_api import async_playwright  # the dev extra

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=binary, headless=True)
        try:
            yield browser
        finally:
            await browser.close()


async def log_in(page: Any, gateway_url: str, token: str) -> None:
    """The dashboard's login form, as an operator fills it."""
    await page.goto(f"{gateway_url}/dashboard/login")
    await page.fill("input[name=token]", token)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{gateway_url}/dashboard/overview")
